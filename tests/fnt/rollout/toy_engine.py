"""A rollout engine written for tests/fnt/rollout/test_engines.py, to show what adding one
takes: this file and one entry in fnt.config.engines.ENGINES. Pure: every step it "samples" the
same four completions of one prompt, rewarded by how many 7s they hold."""

from __future__ import annotations

from fnt.batch import DataPosition, RLBatch
from fnt.config import RLConfig
from fnt.distributed.runtime import Runtime
from fnt.rollout.advantages import group_advantages
from fnt.rollout.pack import pack_rollouts, single_turn
from fnt.rollout.sampling import Completion
from fnt.state import Stateless, TrainState

PROMPT = (3, 4, 5, 6)
COMPLETIONS = ((7, 7, 7, 2), (7, 7, 8, 2), (7, 8, 8, 2), (8, 8, 8, 2))


class ToyEngine(Stateless):
    """The same group of samples at every step."""

    def __init__(self, config: RLConfig, runtime: Runtime) -> None:
        self.config, self.runtime = config, runtime

    def rollout(self, state: TrainState) -> RLBatch:
        rewards = [float(ids.count(7)) for ids in COMPLETIONS]
        advantages = group_advantages([rewards], std_normalize=True)[0].tolist()
        samples = [
            single_turn(PROMPT, Completion(ids, (-1.0,) * len(ids), True), reward, advantage)
            for ids, reward, advantage in zip(COMPLETIONS, rewards, advantages)
        ]
        config = self.config
        micro_batches = pack_rollouts(
            samples,
            num_rows=config.batch_size // self.runtime.dims.dp,
            seq_len=config.seq_len,
            micro_batch_size=config.micro_batch_size,
            temperature=1.0,
            pad_token_id=0,
        )
        cursor = state.progress.data.cursor + len(samples)
        return RLBatch(
            micro_batches=micro_batches,
            num_samples=len(samples),
            data_after=DataPosition(epoch=0, cursor=cursor),
            metrics={"reward/mean": sum(rewards) / len(rewards)},
        )
