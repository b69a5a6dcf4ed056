"""The loss kinds of each family, one entry each: the names `loss.kind`, `loss.aggregation` and
`dpo.loss` offer and what validation, the builder and the steps need to know of a kind, without
torch. Pure, except that `check_rl_loss` and `check_preference_loss` resolve a custom loss's
"module:function" (importing its module).

The importance-sampling corrections between the sampler and the trainer (`loss.is_correction`,
`loss.is_level`) have their table here too; their weights are `steps.rl_losses.is_weights`.

The functions live in the steps package: `steps.rl_losses.LOSS_KINDS` and
`steps.dpo_losses.LOSSES` map the built-in names to them (a custom kind's function is the one
its config key names), and tests/steps/test_loss_tables.py holds those tables and their
functions to these facts. Adding a kind is its function and its entry there, and one entry
here (with its settings, when it has any, as fields of the config section).
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, TypeVar

from fnt.config.references import require_function
from fnt.errors import ConfigError

if TYPE_CHECKING:
    from fnt.config.schema import PreferenceConfig, RLLossConfig


@dataclass(frozen=True)
class RLLoss:
    """What fnt knows of an RL loss kind (`loss.kind`) before torch is imported."""

    summary: str
    """One line for the docs: the mask and where the kind comes from."""
    keys: tuple[str, ...] = ()
    """Its own settings in the loss section, each a finite number >= 0."""
    aggregation: str = ""
    """The aggregation it always uses, whatever loss.aggregation says ("": loss.aggregation)."""
    zero_without_advantages: bool = True
    """Its gradient is exactly 0 when every advantage is 0 (the kl_tau penalty and the reference
    KL aside), so such a step can be skipped."""
    custom: bool = False
    """Its function is the one loss.custom names ("module:function")."""


RL_LOSSES: dict[str, RLLoss] = {
    "dppo_tv": RLLoss(
        summary="mask on the probability change by the advantage's sign (prime-rl's default)",
        keys=("dppo_mask_low", "dppo_mask_high"),
    ),
    "ipo": RLLoss(
        summary="mask where the probability moved by more than ipo_threshold (prime-rl)",
        keys=("ipo_threshold",),
    ),
    "ratio": RLLoss(
        summary="mask on the importance ratio by the advantage's sign (PPO clipping, no min)",
        keys=("eps_low", "eps_high"),
    ),
    "gspo": RLLoss(
        summary="the ratio mask on each sample's geometric-mean ratio (GSPO, Zheng et al. 2025)",
        keys=("gspo_eps_low", "gspo_eps_high"),
        aggregation="sequence",
    ),
    "custom": RLLoss(
        summary='loss.custom = "module:function": fn(inputs, config) -> per-token losses',
        custom=True,
        zero_without_advantages=False,
    ),
}
"""The RL loss kinds by the name loss.kind takes (steps/rl_losses.py has every formula)."""

RL_LOSS_KEYS: tuple[str, ...] = ("kl_tau", "ref_kl_tau")
"""The loss section's numbers every kind shares, each a finite number >= 0."""


@dataclass(frozen=True)
class ISCorrection:
    """What fnt knows of an importance-sampling correction (`loss.is_correction`) before torch
    is imported (steps/rl_losses.py has the formulas)."""

    summary: str
    """One line for the docs: the weight and where it comes from."""
    keys: tuple[str, ...] = ()
    """Its own settings in the loss section."""
    counts: str = ""
    """What its metric loss/is_{counts}_fraction counts: "clipped" (weights truncated),
    "masked" (weights set to 0), or "" (it changes no weight: no metrics)."""


IS_CORRECTIONS: dict[str, ISCorrection] = {
    "none": ISCorrection(summary="no correction: each kind's importance ratio as it is"),
    "tis": ISCorrection(
        summary="truncated IS: w = min(rho, is_cap) (Yao et al. 2025; verl, TRL *_truncate)",
        keys=("is_cap",),
        counts="clipped",
    ),
    "mis": ISCorrection(
        summary="masked IS: w = rho inside is_bounds, else 0 (token level: IcePop; TRL *_mask)",
        keys=("is_bounds",),
        counts="masked",
    ),
}
"""The importance-sampling corrections by the name loss.is_correction takes."""

IS_LEVELS: dict[str, str] = {
    "token": "rho_t = pi_old(token) / pi_sampler(token), one weight per token",
    "sequence": "rho_i = the product of the sample's token ratios, one weight per sample",
}
"""The levels by the name loss.is_level takes, and the ratio each corrects with."""


@dataclass(frozen=True)
class Aggregation:
    """What fnt knows of a loss aggregation (`loss.aggregation`)."""

    summary: str
    """The step's loss over its N loss tokens of S samples, and where it comes from."""
    per_sample: bool
    """fnt.update divides the step's loss sum by its samples S (else by its loss tokens N)."""


AGGREGATIONS: dict[str, Aggregation] = {
    "token": Aggregation("sum of l_t / N (DAPO)", per_sample=False),
    "sequence": Aggregation("sum over samples of their mean l_t / S (GRPO)", per_sample=True),
    "constant": Aggregation("sum of l_t / (S rollout.max_new_tokens) (Dr. GRPO)", per_sample=True),
}
"""The aggregations by the name loss.aggregation takes."""


@dataclass(frozen=True)
class PreferenceLoss:
    """What fnt knows of a preference loss (`dpo.loss`) before torch is imported."""

    summary: str
    """One line for the docs: the loss and its paper."""
    reference_free: bool = False
    """It reads no reference policy: no reference model is built and nothing is precomputed."""
    label_smoothing: bool = False
    """It takes dpo.label_smoothing (the chance that a pair's label is flipped)."""
    per_token_rewards: bool = False
    """Its rewards (and margins) are per response token: the side's log-ratio divided by its
    token count, or, reference-free, beta times its mean logprob."""
    custom: bool = False
    """Its function is the one dpo.custom names ("module:function")."""


PREFERENCE_LOSSES: dict[str, PreferenceLoss] = {
    "sigmoid": PreferenceLoss(
        summary="DPO (Rafailov et al. 2023); with label_smoothing, conservative DPO",
        label_smoothing=True,
    ),
    "ipo": PreferenceLoss(
        summary="IPO (Azar et al. 2023), on per-token log-ratios as TRL",
        per_token_rewards=True,
    ),
    "simpo": PreferenceLoss(
        summary="SimPO (Meng et al. 2024): mean logprobs and a target margin",
        reference_free=True,
        label_smoothing=True,
        per_token_rewards=True,
    ),
    "orpo": PreferenceLoss(
        summary="ORPO (Hong et al. 2024): the chosen side's NLL plus an odds-ratio term",
        reference_free=True,
        per_token_rewards=True,
    ),
    "custom": PreferenceLoss(
        summary='dpo.custom = "module:function": fn(pairs, config) -> per-pair losses',
        custom=True,
    ),
}
"""The preference losses by the name dpo.loss takes (steps/dpo_losses.py has every formula)."""

Entry = TypeVar("Entry")


def entry_of(table: Mapping[str, Entry], name: str, key: str, what: str) -> Entry:
    """The entry of `name` in `table`; ConfigError naming the config `key`, and the entries there
    are, otherwise (`what`: "an RL loss kind")."""
    try:
        return table[name]
    except KeyError:
        close = difflib.get_close_matches(name, table, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"'{key}' = {name!r}: not {what}{hint}; they are {', '.join(table)}"
        ) from None


def rl_loss(kind: str) -> RLLoss:
    """The entry of loss.kind `kind`."""
    return entry_of(RL_LOSSES, kind, "loss.kind", "an RL loss kind")


def preference_loss(name: str) -> PreferenceLoss:
    """The entry of dpo.loss `name`."""
    return entry_of(PREFERENCE_LOSSES, name, "dpo.loss", "a preference loss")


def names_where(table: Mapping[str, Entry], fact: str) -> tuple[str, ...]:
    """The names of the entries whose `fact` is true, in the table's order. Pure."""
    return tuple(name for name, entry in table.items() if getattr(entry, fact))


def check_rl_loss(loss: RLLossConfig) -> None:
    """ConfigError unless the loss section's numbers and custom function can run; resolves
    loss.custom (imports its module)."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'loss.{key}' = {getattr(loss, key)!r}: {message}")

    numbers = [key for entry in RL_LOSSES.values() for key in entry.keys] + list(RL_LOSS_KEYS)
    for key in numbers:
        value = getattr(loss, key)
        require(math.isfinite(value) and value >= 0, key, "must be a finite number >= 0")
    check_is_correction(loss)
    if rl_loss(loss.kind).custom:
        require(
            bool(loss.custom), "custom", f'loss.kind = "{loss.kind}" needs "module:function" here'
        )
        require_function(
            loss.custom, "loss.custom", 2, "a loss fn(inputs, config) (see steps/rl_losses.py)"
        )
    else:
        custom = " or ".join(f'"{name}"' for name in names_where(RL_LOSSES, "custom"))
        require(
            not loss.custom, "custom", f"is set but loss.kind = {loss.kind!r}: set kind = {custom}"
        )


def check_is_correction(loss: RLLossConfig) -> None:
    """ConfigError unless loss.is_correction and its settings can run. Pure."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'loss.{key}' = {getattr(loss, key)!r}: {message}")

    entry_of(IS_CORRECTIONS, loss.is_correction, "loss.is_correction", "a correction")
    entry_of(IS_LEVELS, loss.is_level, "loss.is_level", "a level")
    require(
        math.isfinite(loss.is_cap) and loss.is_cap >= 1,
        "is_cap",
        "must be a finite number >= 1 (a cap below 1 would shrink the weight of a token the "
        "sampler and the trainer agree on, whose ratio is 1)",
    )
    low, high = loss.is_bounds
    require(
        0 <= low <= 1 <= high and math.isfinite(high) and low < high,
        "is_bounds",
        "must be [low, high] with 0 <= low <= 1 <= high, high finite (a ratio of 1, where "
        "the sampler and the trainer agree, must be kept)",
    )
    require(
        loss.is_correction == "none" or not rl_loss(loss.kind).custom,
        "is_correction",
        f'applies to the built-in loss kinds, not loss.kind = "{loss.kind}": a custom loss '
        "weighs its tokens itself (steps.rl_losses.is_weights computes these weights)",
    )


def check_preference_loss(dpo: PreferenceConfig) -> None:
    """ConfigError unless the dpo section's loss settings can run; resolves dpo.custom (imports
    its module)."""

    def require(ok: bool, key: str, message: str) -> None:
        if not ok:
            raise ConfigError(f"'dpo.{key}' = {getattr(dpo, key)!r}: {message}")

    entry = preference_loss(dpo.loss)
    require(math.isfinite(dpo.beta) and dpo.beta > 0, "beta", "must be a finite number > 0")
    require(0 <= dpo.label_smoothing < 0.5, "label_smoothing", "must be in [0, 0.5)")
    smoothed = " or ".join(
        f'"{name}"' for name in names_where(PREFERENCE_LOSSES, "label_smoothing")
    )
    require(
        dpo.label_smoothing == 0 or entry.label_smoothing,
        "label_smoothing",
        f"applies to dpo.loss = {smoothed}, not {dpo.loss!r}",
    )
    require(math.isfinite(dpo.simpo_gamma), "simpo_gamma", "must be a finite number")
    require(
        not (entry.reference_free and dpo.ref_model),
        "ref_model",
        f"dpo.loss = {dpo.loss!r} is reference-free: it reads no reference model",
    )
    require(
        not (entry.reference_free and dpo.precompute_reference),
        "precompute_reference",
        f"dpo.loss = {dpo.loss!r} is reference-free: there is nothing to precompute",
    )
    if entry.custom:
        require(bool(dpo.custom), "custom", f'dpo.loss = "{dpo.loss}" needs "module:function" here')
        require_function(
            dpo.custom,
            "dpo.custom",
            2,
            "a loss fn(pairs, config) -> one value per pair (see steps/dpo_losses.py)",
        )
    else:
        custom = " or ".join(f'"{name}"' for name in names_where(PREFERENCE_LOSSES, "custom"))
        require(
            not dpo.custom,
            "custom",
            f"is set but dpo.loss = {dpo.loss!r}: set dpo.loss = {custom}",
        )
