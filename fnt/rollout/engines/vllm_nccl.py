"""Weights to vLLM servers over NCCL. rollout.vllm.weight_transfer = "nccl" (GPU): each step's
policy goes from rank 0's GPU to every vLLM server over NCCL, through vLLM's own weight-transfer
engine (its trainer half, NCCLTrainerWeightTransferEngine, driving the server's
/init_weight_transfer_engine, /start_weight_update, /update_weights and /finish_weight_update),
instead of through weights/step_N/ on disk. Side effects: one NCCL group per server, opened at the
first send (rank 0 listens on rollout.vllm.nccl_port + i for server i's workers); HTTP to the
servers.

It needs CUDA and vLLM importable in the trainer's environment (the trainer half is vLLM code),
and servers started with --weight-transfer-config '{"backend": "nccl"}' (`fnt vllm-serve` adds
it). The servers hold one policy only, so it runs at rollout.async_level = 0: the driver sends
the policy as each step ends, before the next step's rollouts are asked for.
"""

from __future__ import annotations

from typing import Any, Optional

from fnt.config import ConfigError, RLConfig
from fnt.rollout.publish import published_weights
from fnt.state import TrainState


def trainer_engine_module() -> Any:
    """vLLM's NCCL trainer engine module; ConfigError when vLLM or CUDA is missing here."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "'rollout.vllm.weight_transfer' = 'nccl' sends the weights from the trainer's GPU: "
            "this machine has no CUDA device (use 'disk')"
        )
    try:
        from vllm.distributed.weight_transfer import nccl_engine
    except ImportError as exc:
        raise ConfigError(
            "'rollout.vllm.weight_transfer' = 'nccl' runs vLLM's trainer-side transfer engine, "
            f"which cannot be imported here ({exc}): install vllm into fnt's environment, or "
            "use 'disk'"
        ) from None
    return nccl_engine


def tensor_source(weights: dict) -> Any:
    """A vLLM WeightSource over a state dict (names in Hugging Face form, on the GPU)."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class StateDictSource(WeightSource):
        def metadata(self) -> list:
            return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in weights.items()]

        def __iter__(self):
            for name, tensor in weights.items():
                yield name, tensor.contiguous()

    return StateDictSource()


class NcclWeightSender:
    """Rank 0's NCCL link to each server (`ServerClient`), and the send of one policy."""

    def __init__(self, config: RLConfig) -> None:
        self.config = config
        self.module = trainer_engine_module()
        self.engines: dict[str, Any] = {}  # server URL -> its trainer engine, once opened

    def engine_for(self, server: Any, index: int) -> Any:
        """The trainer engine of `server` (the index-th of rollout.vllm.urls), opening its NCCL
        group at the first call: the server's workers join rank 0 (this process) on
        nccl_address:nccl_port + index."""
        if server.url not in self.engines:
            from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

            settings = self.config.rollout.vllm
            workers = server.call("/get_world_size", None, "asking its world size")
            init = self.module.NCCLTrainerInitInfo(
                master_address=settings.nccl_address,
                master_port=settings.nccl_port + index,
                world_size=1 + int(workers["world_size"]),
                rank=0,
            )
            client = HTTPVLLMWeightSyncClient(server.url, timeout=self.config.rollout.timeout_s)
            self.engines[server.url] = self.module.NCCLTrainerWeightTransferEngine.trainer_init(
                init, client=client, source=tensor_source({})
            )
        return self.engines[server.url]

    def send_(self, weights: dict, servers: list, version: int) -> None:
        """Load `weights` (the policy after step `version`) into every server: pause it (running
        requests finish), send over NCCL, drop its prefix cache, record the version, resume."""
        source = tensor_source(weights)
        for index, server in enumerate(servers):
            what = f"sending the policy of step {version} over NCCL"
            engine = self.engine_for(server, index)
            server.call("/pause?mode=wait", {}, what)
            engine.source = source
            engine.send_weights()
            server.call("/reset_prefix_cache", {}, what)
            server.call("/update_weight_version", {"new_version": str(version)}, what)
            server.call("/resume", {}, what)
            server.version = version

    def close(self) -> None:
        for engine in self.engines.values():
            engine.shutdown()
        self.engines.clear()


def send_policy_(state: TrainState, sender: Optional[NcclWeightSender], servers: list) -> None:
    """Every rank: gather the policy on the GPU; rank 0 (the one with a sender) sends it."""
    weights = published_weights(state, cpu_offload=False)
    if sender is not None:
        sender.send_(weights, servers, state.progress.step)
