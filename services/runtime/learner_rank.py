"""One DeepSpeed learner rank without Ray (the Ray actors in `learner_group` and the local runtime run it)."""
from __future__ import annotations

import time
from pathlib import Path

import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.services.config import TrainConfig
from steadyrl.services.runtime.builders import build_learner
from steadyrl.services.runtime.rank_env import set_rank_env
from steadyrl.services.testbeds import build_testbed
from steadyrl.trainer.controls import UpdateControls


class LearnerRank:
    """One DeepSpeed rank without Ray: the engine for the run's policy, its update, weights and checkpoints. The
    local runtime runs one in its process; `LearnerActor` runs one per Ray actor."""

    def __init__(self, cfg: TrainConfig, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.learner = None

    def build(self, base_weights: dict[str, torch.Tensor], master_addr: str, master_port: int) -> None:
        """Join the process group (every rank at once) and build the engine."""
        set_rank_env(master_port, self.rank, self.world_size, master_addr)
        torch.manual_seed(self.cfg.run.seed)
        testbed = build_testbed(self.cfg)
        self.learner = build_learner(self.cfg, testbed.build_policy(base_weights).train(), testbed.build_sampler())

    def update(self, *batches: RolloutBatch, controls: UpdateControls | None = None) -> dict[str, float]:
        """One update on the workers' batches together; its metrics (with `timing_s/update`)."""
        t0 = time.perf_counter()
        metrics = self.learner.update(RolloutBatch.concat(batches), controls)
        metrics["timing_s/update"] = time.perf_counter() - t0
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained tensors (`Learner.weights`)."""
        return self.learner.weights()

    def sampling_weights(self) -> dict[str, torch.Tensor]:
        """What the rollout workers sample with (`Learner.sampling_weights`)."""
        return self.learner.sampling_weights()

    def save(self, directory: str) -> None:
        self.learner.save(Path(directory))

    def load(self, directory: str) -> None:
        self.learner.load(Path(directory))

    def save_batch(self, directory: str) -> None:
        self.learner.save_batch(Path(directory))
