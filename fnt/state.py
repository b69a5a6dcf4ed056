"""The records the fold passes along: Progress, Handles and TrainState. Pure.

Progress holds plain values only and round-trips through JSON, so it can be checkpointed,
logged and compared. Handles hold references to objects whose contents change in place (model,
optimizer); the references themselves never change. Anything derivable from the config and
`progress.step` (learning rate, seeds, data order) is derived, not stored.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Union

from dataclasses_json import dataclass_json

from fnt.batch import DataPosition

if TYPE_CHECKING:
    from fnt.data.sft import JsonlData
    from fnt.rollout.engine import InProcessEngine
    from fnt.rollout.external import ExternalRollouts
    from fnt.validation_pass import ValData


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
    """References to what the step functions mutate; the referents change, the references never."""

    model: Any
    """The (possibly FSDP2-sharded) model."""
    optimizer: Any
    """The optimizer over the model's parameters."""
    runtime: Any
    """The frozen runtime record from setup_trainer (ranks, device, mesh)."""
    cursor: StepCursor
    """Guard against stepping a consumed state."""
    data: Optional[JsonlData] = None
    """SFT on JSONL sources: the tokenized corpus and its sample order (None otherwise)."""
    rollouts: Optional[Union[InProcessEngine, ExternalRollouts]] = None
    """RL: where each step's rollouts come from (None for SFT)."""
    ref_model: Any = None
    """RL with loss.ref_kl_tau > 0 and ref_source = "model": the frozen reference policy, sharded
    like the model, without gradients; never in the optimizer or a checkpoint (None otherwise)."""
    val: Optional[ValData] = None
    """The validation samples and prompts (fnt.validation_pass); None without validation."""


@dataclass(frozen=True)
class TrainState:
    """The record the fold passes from step to step."""

    config: Any
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
