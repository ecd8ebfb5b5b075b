"""The digits testbed: class-conditional 8x8 images, a classifier ensemble, a gold classifier."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from steadyrl.reward.ensemble import EnsembleScores, RewardEnsemble
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.samplers import build_sampler
from steadyrl.services.testbeds.base import Testbed


class DigitsTestbed(Testbed):
    """Class-conditional 8x8 digits: classifier ensemble rewards, a gold classifier as the monitor."""

    name = "digits"

    def base_weights(self, progress: bool = True) -> Path:
        from steadyrl.trainer.pretrain import ensure_pretrained_unet

        cfg = self.cfg
        return ensure_pretrained_unet(cfg.model, cfg.scheduler, cfg.pretrain, progress=progress,
                                      prediction=cfg.sampler.prediction)

    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.models import class_policy_from_weights

        return class_policy_from_weights(self.cfg.model, weights)

    def build_sampler(self):
        return build_sampler(self.cfg.sampler, self.cfg.scheduler)

    @property
    def max_workers(self) -> int:
        from steadyrl.rollout.digits import NUM_CLASSES

        return NUM_CLASSES

    def _classes(self, worker: int, n_workers: int) -> np.ndarray:
        from steadyrl.rollout.digits import NUM_CLASSES

        return np.array_split(np.arange(NUM_CLASSES), n_workers)[worker]

    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        classes = self._classes(worker, n_workers)
        return torch.as_tensor(classes, dtype=torch.long), int(classes[0])

    def eval_prompts(self) -> Tensor:
        from steadyrl.rollout.digits import NUM_CLASSES

        return torch.arange(NUM_CLASSES)

    def prepare_rewards(self, console=None) -> None:
        from steadyrl.reward.config import build_reward_models, print_accuracies

        members, monitors, _ = build_reward_models(self.cfg.reward)
        if console is not None:
            print_accuracies(members, monitors, console)

    def reward_ensemble(self) -> RewardEnsemble:
        from steadyrl.reward.config import build_reward_models

        members, monitors, feature = build_reward_models(self.cfg.reward)
        return RewardEnsemble(members, self.cfg.reward.train_on, monitors, next(m for m in members if m.name == feature))

    def reward_spec(self) -> Any:
        return self.cfg.reward

    @property
    def gold_name(self) -> str:
        return self.cfg.reward.gold.name

    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        from steadyrl.reward.evaluation import class_grid, eval_summary
        from steadyrl.rollout.digits import NUM_CLASSES

        result = eval_summary(batch.cond, batch.group, scores, self.gold_name, NUM_CLASSES)
        result["breakdown"] = {str(c): a for c, a in enumerate(result["gold_accuracy_per_class"])}
        result["grid"] = class_grid(batch.samples, NUM_CLASSES, 8)
        return result

    def save_eval(self, result: dict[str, Any], path_stem: Path, title: str) -> None:
        from steadyrl.services.report import save_sample_grid

        save_sample_grid(result.pop("grid"), path_stem.with_suffix(".png"), title, result["gold_accuracy_per_class"])
