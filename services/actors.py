"""Ray actors: rollout workers (sampling + reward scoring via Serve) and the DeepSpeed learner."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve

from reward.diversity import nearest_neighbour_distance
from reward.ensemble import attach_scores
from reward.evaluation import class_grid, eval_summary
from rollout.batch import RolloutBatch
from rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from rollout.models import unet_from_weights
from rollout.samplers import build_sampler
from services.builders import build_learner
from services.config import TrainConfig
from services.reward_app import APP_NAME
from services.runtime import redirect_output, set_rank_env


def _setup_process(cfg: TrainConfig, log_file: Path) -> None:
    redirect_output(log_file)
    torch.set_num_threads(cfg.ray.torch_threads or os.cpu_count() or 1)


def step_seed(seed: int, step: int, worker: int) -> int:
    """Per-step, per-worker sampling seed: resuming at step k replays exactly the same noise."""
    return (seed * 1_000_003 + step * 1009 + worker) % (2**63 - 1)


@ray.remote
class RolloutWorker:
    """Holds a policy copy; samples groups per class and scores them through the Serve ensemble."""

    def __init__(self, cfg: dict[str, Any], base_weights: dict[str, torch.Tensor], classes: list[int], index: int,
                 run_dir: str, group_offset: int = 0):
        self.cfg = TrainConfig.model_validate(cfg)
        _setup_process(self.cfg, Path(run_dir) / "logs" / f"rollout_{index}.log")
        self.index = index
        self.class_ids = torch.tensor(classes, dtype=torch.long)
        self.group_offset = group_offset
        self.policy = unet_from_weights(self.cfg.model, base_weights)
        self.sampler = build_sampler(self.cfg.sampler, self.cfg.scheduler)
        self.reward = serve.get_app_handle(APP_NAME)

    def _score(self, batch: RolloutBatch) -> tuple[RolloutBatch, Any]:
        scores = self.reward.score_tensors.remote(batch.samples, batch.cond, batch.group).result()
        return attach_scores(batch, scores), scores

    @ray.method(num_returns=2)
    def generate(self, step: int) -> tuple[RolloutBatch, dict[str, float]]:
        """(batch for the learner, small summary for the driver)."""
        gen = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, step, self.index))
        t0 = time.perf_counter()
        batch = self.sampler.sample(self.policy, self.class_ids, self.cfg.sampler.samples_per_class, gen,
                                    sample_shape=IMAGE_SHAPE, group_offset=self.group_offset)
        t1 = time.perf_counter()
        batch, scores = self._score(batch)
        t2 = time.perf_counter()
        gold = self.cfg.reward.gold.name
        summary = {
            "reward/train_mean": float(scores.reward.mean()),
            "reward/ensemble_mean": float(scores.mean.mean()),
            "reward/ensemble_std": float(scores.std.mean()),
            "reward/uncertainty_mean": float(scores.uncertainty.mean()),
            "reward/gold_mean": float(scores.monitors[gold].mean()),
            "reward/gold_accuracy": float(scores.monitors[f"{gold}_correct"].mean()),
            "diversity/nn_distance": float(nearest_neighbour_distance(scores.features, batch.group).mean()),
            "timing_s/rollout": t1 - t0,
            "timing_s/reward": t2 - t1,
            "n": float(len(batch)),
        }
        for name, col in zip(scores.names, scores.scores.T):
            summary[f"reward/{name}"] = float(col.mean())
        return batch, summary

    def ready(self) -> bool:
        return True

    def set_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.policy.load_state_dict(weights)

    def evaluate(self, n_per_class: int, seed: int, grid_per_class: int = 8) -> dict[str, Any]:
        """Gold accuracy per class, proxy reward and diversity on seeded samples; a small sample grid."""
        gen = torch.Generator().manual_seed(seed)
        batch = self.sampler.sample(self.policy, torch.arange(NUM_CLASSES), n_per_class, gen,
                                    sample_shape=IMAGE_SHAPE)
        batch, scores = self._score(batch)
        result = eval_summary(batch.cond, batch.group, scores, self.cfg.reward.gold.name, NUM_CLASSES)
        result["grid"] = class_grid(batch.samples, NUM_CLASSES, grid_per_class)
        return result


@ray.remote
class LearnerActor:
    """Hosts the DeepSpeed engine (rank 0 of a world of 1 for now; an actor group later)."""

    def __init__(self, cfg: dict[str, Any], base_weights: dict[str, torch.Tensor], run_dir: str, master_port: int,
                 rank: int = 0, world_size: int = 1):
        self.cfg = TrainConfig.model_validate(cfg)
        _setup_process(self.cfg, Path(run_dir) / "logs" / f"learner_{rank}.log")
        set_rank_env(master_port, rank, world_size)
        torch.manual_seed(self.cfg.run.seed)
        self.learner = build_learner(self.cfg, unet_from_weights(self.cfg.model, base_weights).train())

    def ready(self) -> bool:
        return True

    def update(self, *batches: RolloutBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.learner.update(RolloutBatch.concat(batches))
        metrics["timing_s/update"] = time.perf_counter() - t0
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        return self.learner.weights()

    def save(self, directory: str) -> None:
        self.learner.save(Path(directory))

    def load(self, directory: str) -> None:
        self.learner.load(Path(directory))
