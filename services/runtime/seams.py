"""What the controller may call on a runtime: its rollout pool and its learner, as typed handles. The Ray runtime's
(`ray_runtime`: `RolloutPool`, `LearnerGroup`) and the local runtime's (`local_runtime`: `LocalRolloutPool`,
`LocalLearner`) satisfy them; a batch is whatever the pool's `collect` returns and the learner's `update` takes
(ObjectRefs of `RolloutBatch`es under Ray, the batches themselves in one process)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from steadyrl.trainer.controls import UpdateControls


class LearnerHandle(Protocol):
    """The learner: one DeepSpeed rank, or every rank of a group (each call reaches all of them)."""

    def update(self, batches: list[Any], controls: UpdateControls | None = None) -> dict[str, float]:
        """One update on the workers' batches together; its metrics (every rank's are equal)."""

    def save(self, directory: str) -> None:
        """The learner's state into a checkpoint folder (every rank its part)."""

    def load(self, directory: str) -> None:
        """The learner's state from a checkpoint folder."""

    def save_batch(self, directory: str) -> None:
        """The last update's batch, as it arrived (what the health watch keeps of an anomaly)."""


class RolloutPoolHandle(Protocol):
    """The rollout workers: each step's rollouts are launched (with the weights last published, or recorded ones)
    and collected later; pipelining keeps several launched at once."""

    restarts_this_step: int  # workers restarted since `begin_step` (faults/rollout_restarts)

    def begin_step(self) -> None:
        """A new step: its fault counters start at zero."""

    def launch(self, step: int) -> None:
        """Start every worker's rollout of `step` with the weights last published."""

    def collect(self, step: int) -> tuple[list[Any], list[dict[str, float]]]:
        """Wait for `step`'s rollouts: (each worker's batch, each worker's summary)."""

    def publish(self, version: int) -> float:
        """Load the learner's sampling weights (policy version `version`) into every worker."""

    def evaluate(self, seed: int) -> dict[str, Any]:
        """The held-out evaluation with the weights last published."""

    def in_flight(self) -> dict[int, int]:
        """step -> policy version of the rollouts launched and not yet collected."""

    def save_in_flight(self, directory: Path) -> None:
        """The weights of in-flight rollouts older than the learner's, into a checkpoint folder."""

    def discard_in_flight(self) -> None:
        """Forget the rollouts launched and not collected (a rollback)."""

    def relaunch(self, in_flight: dict[str, int], directory: Path) -> None:
        """Launch again the rollouts a checkpoint recorded as in flight, each with the policy it had."""


class Runtime(Protocol):
    """Where the pool and the learner run (`run.runtime`: ray or local)."""

    name: str

    def start(self, base_model: Path) -> tuple[RolloutPoolHandle, LearnerHandle]:
        """Build the pool and the learner from the base model's weights file."""

    def shutdown(self) -> None:
        """Stop everything `start` began (safe to call when it did not finish)."""
