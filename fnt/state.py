"""The records the fold passes along: Progress, Handles and TrainState, and the protocols of the
handles that batch sources read. Pure, except `TrainState.advance`, which moves the handles'
step cursor along with the state it returns (so that a consumed state cannot be stepped again).

Progress holds plain values only and round-trips through JSON, so it can be checkpointed,
logged and compared. Handles hold references to objects whose contents change in place (model,
optimizer, the sources' handles); the references themselves never change. Anything derivable
from the config and `progress.step` (learning rate, seeds, data order) is derived, not stored.

The core names what it needs from a source's handle, never its type: every one is a `Component`
(its state is saved in each checkpoint and restored with it, and it is closed when the run
ends), SFT data is a `SampleSource`, an RL engine a `RolloutSource` and the held-out data an
`Evaluator`. The implementations (fnt.data, fnt.rollout, fnt.evaluation) import this module,
not the other way round.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Optional, Protocol

from dataclasses_json import dataclass_json

from fnt.batch import DataPosition, RLBatch, SftBatch

if TYPE_CHECKING:
    import torch
    from torch import nn

    from fnt.config import Config
    from fnt.distributed.runtime import Runtime


class Component(Protocol):
    """A handle with a lifecycle: the driver saves `state_dict()` inside every checkpoint (the
    same transaction as the weights), `restore_` passes it back to `load_state_dict`, and the
    driver calls `close()` when the run ends, however it ends. A component whose state follows
    from the config and Progress returns an empty dict."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs that the config and Progress do not say (tensors allowed)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take back what `state_dict` returned (in the checkpoint a run resumes from)."""
        ...

    def close(self) -> None:
        """Stop background work and release resources; the handle is not used afterwards."""
        ...


class Stateless:
    """A Component whose state follows from the config and Progress and that runs nothing in the
    background: nothing to save, restore or stop."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class SampleSource(Component, Protocol):
    """SFT data (synthetic, or the corpus of data.sources): this rank's batch of the update
    after `progress` (it starts at `progress.data`)."""

    def batch(self, progress: Progress) -> SftBatch: ...


class RolloutSource(Component, Protocol):
    """RL rollouts: this rank's batch of the update after `state`."""

    def rollout(self, state: TrainState) -> RLBatch: ...


class Evaluator(Component, Protocol):
    """Held-out evaluation: the metrics of the model as `state` holds it, without the val/
    prefix (e.g. loss, perplexity, num_tokens, reward/mean). Every rank calls it at the same
    point; it changes nothing that training uses."""

    def evaluate(self, state: TrainState) -> dict[str, float]: ...


@dataclass_json
@dataclass(frozen=True)
class Progress:
    """How far training has come. `step` counts completed optimizer updates."""

    step: int = 0
    """Completed optimizer updates; the next update is step + 1."""
    total_tokens: int = 0
    """Tokens processed (all positions of all rows), summed over ranks."""
    total_samples: int = 0
    """Samples (documents) processed, summed over ranks."""
    data: DataPosition = field(default_factory=DataPosition)
    """Where the data stream stands after `step` updates."""


class StaleStateError(RuntimeError):
    """A TrainState was stepped after a successor had already been produced from it."""


class StepCursor:
    """The step the live model and optimizer are at; guards against stepping a consumed state.

    Tensors update in place, so stepping an old TrainState would silently train twice from the
    wrong place. The cursor is the one mutable cell that makes that mistake raise instead.
    """

    def __init__(self, step: int) -> None:
        self.step = step

    def move_(self, from_step: int, to_step: int) -> None:
        """Record that the live model went from `from_step` to `to_step` (an update or a
        restore); raises StaleStateError when it is not at `from_step`."""
        if from_step != self.step:
            raise StaleStateError(
                f"this TrainState is at step {from_step} but the model is at step {self.step}: "
                "a state can be stepped only once; use the state the step function returned"
            )
        self.step = to_step


@dataclass(frozen=True)
class Handles:
    """References to what the step functions and sources use. The model, the optimizer and the
    sources' handles change in place; the references never change."""

    model: nn.Module
    """The (possibly FSDP2-sharded) model."""
    optimizer: torch.optim.Optimizer
    """The optimizer over the model's trainable parameters."""
    runtime: Runtime
    """The frozen runtime record from setup_trainer (ranks, device, mesh)."""
    cursor: StepCursor
    """Guard against stepping a consumed state."""
    data: Optional[SampleSource] = None
    """SFT: the synthetic rows, or the tokenized corpus of data.sources and its sample order
    (None for RL)."""
    rollouts: Optional[RolloutSource] = None
    """RL: where each step's rollouts come from (None for SFT)."""
    ref_model: Optional[nn.Module] = None
    """RL with loss.ref_kl_tau > 0 and ref_source = "model": the frozen reference policy, sharded
    like the model, without gradients; never in the optimizer or a checkpoint (None otherwise).
    With LoRA it is `model` itself, whose base (adapters off) is the reference."""
    val: Optional[Evaluator] = None
    """The held-out samples and prompts (fnt.evaluation.held_out.EvalData); None without [val]."""

    def components(self) -> dict[str, Component]:
        """The sources' handles this state has, by field name: what checkpoints save and restore
        and what the driver closes."""
        return {
            name: handle
            for name in ("data", "rollouts", "val")
            if (handle := getattr(self, name)) is not None
        }


@dataclass(frozen=True)
class TrainState:
    """The record the fold passes from step to step."""

    config: Config
    progress: Progress
    handles: Handles

    def advance(self, **changes: Any) -> TrainState:
        """The successor state after one optimizer update, with the given Progress changes.

        Marks this state consumed: advancing it (or stepping it) again raises StaleStateError.
        """
        if "step" in changes:
            raise TypeError("advance() sets the step itself; pass only the other Progress fields")
        progress = dataclasses.replace(self.progress, step=self.progress.step + 1, **changes)
        self.handles.cursor.move_(self.progress.step, self.progress.step + 1)
        return dataclasses.replace(self, progress=progress)

    def check_current(self) -> None:
        """Raise StaleStateError unless this state is the newest one for its handles."""
        if self.handles.cursor.step != self.progress.step:
            raise StaleStateError(
                f"this TrainState is at step {self.progress.step} but the model is at step "
                f"{self.handles.cursor.step}: use the state the step function returned"
            )
