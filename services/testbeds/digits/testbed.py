"""The digits testbed: class-conditional 8x8 images, a classifier ensemble, a gold classifier."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar, Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor, nn

from steadyrl.reward.config import RewardConfig
from steadyrl.reward.ensemble import EnsembleScores
from steadyrl.reward.ensemble_spec import EnsembleSpec
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import SchedulerConfig, UNetConfig
from steadyrl.rollout.digits import NUM_CLASSES
from steadyrl.rollout.sampler_factory import build_sampler
from steadyrl.services.testbeds.base import Testbed
from steadyrl.services.testbeds.digits.pretrain import PretrainConfig
from steadyrl.services.testbeds.digits.rest import DigitsRequest, ScoreRequest
from steadyrl.services.testbeds.rest import RestProfile
from steadyrl.services.testbeds.settings import TestbedSettings


class DigitsSettings(TestbedSettings):
    """The digits testbed: a class-conditional UNet pre-trained here, a classifier ensemble as the reward and a
    gold classifier (disjoint data, never trained on) as the held-out judge."""

    name: Literal["digits"] = "digits"
    model: UNetConfig = Field(default_factory=UNetConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    eval_samples_per_class: int = Field(50, ge=1, description="seeded samples of each class per evaluation")

    sampler_kinds: ClassVar[tuple[str, ...]] = ("ddim", "flow_sde")
    no_reward_backprop: ClassVar[str | None] = None

    def max_workers(self) -> int:
        """One class per worker at most."""
        return NUM_CLASSES

    def differentiable_reward(self) -> Callable[[Tensor, Tensor], Tensor]:
        """The `train_on` classifier's probability of the asked digit (or the members' mean)."""
        from steadyrl.reward.config import differentiable_train_reward

        return differentiable_train_reward(self.reward)


class DigitsTestbed(Testbed):
    """Class-conditional 8x8 digits: classifier ensemble rewards, a gold classifier as the monitor."""

    name = "digits"
    Settings = DigitsSettings
    rest = RestProfile("digits", DigitsRequest, legacy_route="/score", legacy_request=ScoreRequest)
    settings: DigitsSettings

    def base_weights(self, progress: bool = True) -> Path:
        from steadyrl.services.testbeds.digits.pretrain import ensure_pretrained_unet

        s = self.settings
        return ensure_pretrained_unet(s.model, s.scheduler, s.pretrain, progress=progress,
                                      prediction=self.cfg.sampler.prediction)

    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.models import class_policy_from_weights

        return class_policy_from_weights(self.settings.model, weights)

    def build_sampler(self):
        return build_sampler(self.cfg.sampler, self.settings.scheduler)

    def _classes(self, worker: int, n_workers: int) -> np.ndarray:
        return np.array_split(np.arange(NUM_CLASSES), n_workers)[worker]

    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        classes = self._classes(worker, n_workers)
        return torch.as_tensor(classes, dtype=torch.long), int(classes[0])

    def eval_prompts(self) -> Tensor:
        return torch.arange(NUM_CLASSES)

    @property
    def eval_per_prompt(self) -> int:
        return self.settings.eval_samples_per_class

    def prepare_rewards(self, console=None) -> None:
        from steadyrl.reward.config import build_reward_models, print_accuracies

        members, monitors, _ = build_reward_models(self.settings.reward)  # trains missing ones; checks accuracy
        if console is not None:
            print_accuracies(members, monitors, console)

    def reward_spec(self) -> EnsembleSpec:
        return self.settings.reward.ensemble_spec()

    @property
    def gold_name(self) -> str:
        return self.settings.reward.gold.name

    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        from steadyrl.reward.evaluation import class_grid, eval_summary

        result = eval_summary(batch.cond, batch.group, scores, self.gold_name, NUM_CLASSES)
        result["breakdown"] = {str(c): a for c, a in enumerate(result["held_out_per_class"])}
        result["grid"] = class_grid(batch.samples, NUM_CLASSES, 8)
        return result

    def save_eval(self, result: dict[str, Any], path_stem: Path, title: str) -> None:
        from steadyrl.services.run_folder.figures import save_sample_grid

        save_sample_grid(result.pop("grid"), path_stem.with_suffix(".png"), title, result["held_out_per_class"])
