"""One DeepSpeed learner rank without Ray: `build_rank` builds its `DeepSpeedLearner` and `update_on` runs one
update on the rollout workers' batches. The Ray learner actors (`learner_group.LearnerActor`) and the local
runtime (`local_runtime.LocalLearner`) each hold the learner this builds (`HoldsRank`) and call it directly."""
from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.services.config import TrainConfig
from steadyrl.services.runtime.builders import build_learner
from steadyrl.services.runtime.rank_env import join_process_group, set_rank_env
from steadyrl.services.testbeds import build_testbed
from steadyrl.trainer.controls import UpdateControls
from steadyrl.trainer.deepspeed_config import communication_backend
from steadyrl.trainer.learner import DeepSpeedLearner


class HoldsRank:
    """What a holder of one rank's learner (`self.learner`, built by `build_rank`) answers for it: its weights and
    checkpoints, with folders as strings (they cross Ray's boundary so)."""

    learner: DeepSpeedLearner | None

    def weights(self) -> dict[str, torch.Tensor]:
        """The trained tensors (`DeepSpeedLearner.weights`)."""
        return self.learner.weights()

    def sampling_weights(self) -> dict[str, torch.Tensor]:
        """What the rollout workers sample with (`DeepSpeedLearner.sampling_weights`)."""
        return self.learner.sampling_weights()

    def save(self, directory: str) -> None:
        self.learner.save(Path(directory))

    def load(self, directory: str) -> None:
        self.learner.load(Path(directory))

    def save_batch(self, directory: str) -> None:
        self.learner.save_batch(Path(directory))


def build_rank(cfg: TrainConfig, base_weights: dict[str, torch.Tensor], rank: int, world_size: int,
               master_addr: str, master_port: int) -> DeepSpeedLearner:
    """Join the process group at (`master_addr`, `master_port`) (every rank at once) and build the engine for the
    run's policy from `base_weights`."""
    set_rank_env(master_port, rank, world_size, master_addr)
    if not torch.distributed.is_initialized():
        join_process_group(communication_backend(cfg.learner.backend), rank, world_size, master_addr, master_port)
    torch.manual_seed(cfg.run.seed)
    testbed = build_testbed(cfg)
    return build_learner(cfg, testbed.build_policy(base_weights).train(), testbed.build_sampler())


def update_on(learner: DeepSpeedLearner, batches: Sequence[RolloutBatch],
              controls: UpdateControls | None = None) -> dict[str, float]:
    """One update on the workers' batches together; its metrics, with `timing_s/update`."""
    t0 = time.perf_counter()
    metrics = learner.update(RolloutBatch.concat(batches), controls)
    metrics["timing_s/update"] = time.perf_counter() - t0
    return metrics
