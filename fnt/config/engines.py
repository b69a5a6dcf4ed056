"""The rollout engines, one entry each: everything config validation, preflight, the builder and
the command line need to know of an engine, without importing it. Pure: an entry names its
implementation as "module:attribute", imported only by a run that uses that engine.

Adding an engine is its implementation's file (a class built as `cls(config, runtime)` that is
a `fnt.state.RolloutSource`) and one entry here, with the checks of its own keys beside it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

from fnt.errors import ConfigError

if TYPE_CHECKING:
    from fnt.config.schema import RolloutConfig


@dataclass(frozen=True)
class Engine:
    """What fnt knows of a rollout engine before it is imported."""

    summary: str
    """One line for the docs: where the rollouts come from."""
    build: str
    """"module:attribute" of the rollouts handle, called as build(config, runtime)."""
    samples_prompts: bool
    """It samples completions of rollout.prompts and scores them with rollout.reward: those keys
    are checked, and the prompts file is read before any model is built."""
    publish: str = ""
    """"module:function" the driver calls with every state it reaches, the start state
    included, to serve the policy to whoever samples (empty: the engine reads the policy
    itself)."""
    lora_publish: str = "adapter"
    """What rollout.publish = "auto" publishes of a LoRA policy: "adapter" or "merged"."""
    ref_logprobs: bool = False
    """Its samples may carry reference logprobs (loss.ref_source = "rollouts")."""
    greedy_eval: bool = False
    """It holds an inference copy of the policy, which answers val.prompts greedily."""
    filters_groups: bool = False
    """It can replace groups without signal by new prompts' (rollout.filter_groups)."""
    check: Optional[Callable[[RolloutConfig], None]] = None
    """ConfigError unless its own keys can run; pure, and torch-free like all validation."""


def check_vllm(rollout: RolloutConfig) -> None:
    """ConfigError unless the vLLM engine's settings can run. Pure."""
    vllm = rollout.vllm

    def require(ok: bool, key: str, value: Any, message: str) -> None:
        if not ok:
            raise ConfigError(f"'rollout.{key}' = {value!r}: {message}")

    require(bool(vllm.urls), "vllm.urls", vllm.urls, "name at least one server")
    for url in vllm.urls:
        require(
            url.startswith(("http://", "https://")),
            "vllm.urls",
            url,
            "each server is a base URL such as http://127.0.0.1:8000",
        )
    require(0 < vllm.top_p <= 1, "vllm.top_p", vllm.top_p, "must be in (0, 1]")
    require(vllm.startup_timeout_s > 0, "vllm.startup_timeout_s", vllm.startup_timeout_s, "> 0")
    require(vllm.retry_s >= 0, "vllm.retry_s", vllm.retry_s, "must be >= 0")
    require(
        0 < vllm.gpu_memory_utilization <= 1,
        "vllm.gpu_memory_utilization",
        vllm.gpu_memory_utilization,
        "must be in (0, 1]",
    )
    require(vllm.kv_cache_gb >= 0, "vllm.kv_cache_gb", vllm.kv_cache_gb, "must be >= 0")
    require(
        rollout.keep_weights > rollout.async_level,
        "keep_weights",
        rollout.keep_weights,
        f"must be more than rollout.async_level = {rollout.async_level}: the servers load the "
        "policy of up to async_level steps ago from weights/",
    )
    require(
        rollout.publish != "adapter",
        "publish",
        rollout.publish,
        'the vLLM engine reloads full weights into its servers; use "merged" (or "auto")',
    )
    require(
        vllm.weight_transfer == "disk" or rollout.async_level == 0,
        "vllm.weight_transfer",
        vllm.weight_transfer,
        f"needs rollout.async_level = 0 (it is {rollout.async_level}): over NCCL the servers "
        "get each policy as its step ends, so they hold no older one to sample from",
    )
    require(
        0 < vllm.nccl_port and vllm.nccl_port + len(vllm.urls) <= 65536,
        "vllm.nccl_port",
        vllm.nccl_port,
        "must leave a TCP port for each server (nccl_port + i)",
    )


ENGINES: dict[str, Engine] = {
    "in_process": Engine(
        summary="an inference copy of the policy in every trainer process generates",
        build="fnt.rollout.engines.in_process:InProcessEngine",
        samples_prompts=True,
        greedy_eval=True,
        filters_groups=True,
    ),
    "external": Engine(
        summary="an orchestrator writes {output_dir}/rollouts/step_N/ and reads weights/",
        build="fnt.rollout.engines.external:ExternalRollouts",
        samples_prompts=False,
        publish="fnt.rollout.publish:publish_weights_",
        ref_logprobs=True,
    ),
    "vllm": Engine(
        summary="vLLM servers generate, reloading each published policy",
        build="fnt.rollout.engines.vllm:VLLMEngine",
        samples_prompts=True,
        publish="fnt.rollout.engines.vllm:publish_to_vllm_",
        lora_publish="merged",
        check=check_vllm,
    ),
}
"""The rollout engines by the name rollout.engine takes."""


def engine_of(rollout: RolloutConfig) -> Engine:
    """The entry of rollout.engine; ConfigError naming the engines there are otherwise."""
    try:
        return ENGINES[rollout.engine]
    except KeyError:
        close = difflib.get_close_matches(rollout.engine, ENGINES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"'rollout.engine' = {rollout.engine!r}: not a rollout engine{hint}; "
            f"the engines are {', '.join(ENGINES)}"
        ) from None
