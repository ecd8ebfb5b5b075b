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
from steadyrl.services.testbeds.base import PromptError, Testbed
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

    def export(self, policy: nn.Module, out: Path, merge: bool = False):
        """The class-conditional UNet2DModel as diffusers saves it, its noise schedule (`scheduler/`: DDIM, or the
        flow's FlowMatchEulerDiscreteScheduler at `sampler.shift`) and `sampling.json` (rollout/diffusers_export.py).
        Nothing to merge: `merge` changes nothing."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        from steadyrl.rollout.diffusers_export import class_unet_snippet, save_class_unet
        from steadyrl.rollout.digits import IMAGE_SHAPE
        from steadyrl.rollout.models import build_scheduler
        from steadyrl.services.run_folder.model_card import ExportInfo

        s, sampler = self.settings, self.cfg.sampler
        flow = sampler.kind == "flow_sde"
        scheduler = (FlowMatchEulerDiscreteScheduler(num_train_timesteps=s.scheduler.num_train_timesteps,
                                                     shift=sampler.shift) if flow else build_scheduler(s.scheduler))
        sampling = {"class_labels": f"class id c in 0..{s.model.num_classes - 1} enters as `class_labels=c` "
                                    "(the digit itself)",
                    "prediction": sampler.prediction, "timesteps": "scheduler.timesteps" + (
                        " (sigma * num_train_timesteps)" if flow else ""),
                    "sample_shape": list(IMAGE_SHAPE), "value_range": "[-1, 1]; pixels = (x + 1) / 2",
                    "scheduler": type(scheduler).__name__, "trained_with_sampler": sampler.model_dump()}
        save_class_unet(policy.net, scheduler, out, sampling)
        kind = f"{'velocity (rectified flow)' if flow else 'epsilon'}-prediction"
        return ExportInfo(
            format=f"A class-conditional UNet2DModel ({kind}, {s.model.num_classes} classes as `class_labels`) as "
            f"diffusers saves it, with its {type(scheduler).__name__} in scheduler/ and sampling.json",
            library="diffusers", load=class_unet_snippet(type(scheduler).__name__, s.model.num_classes, IMAGE_SHAPE,
                                                         sampler.num_steps),
            tags=("diffusers", "class-conditional-image-generation", "digits"))

    def _classes(self, worker: int, n_workers: int) -> np.ndarray:
        return np.array_split(np.arange(NUM_CLASSES), n_workers)[worker]

    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        classes = self._classes(worker, n_workers)
        return torch.as_tensor(classes, dtype=torch.long), int(classes[0])

    def eval_prompts(self) -> Tensor:
        return torch.arange(NUM_CLASSES)

    def prompts_from_text(self, texts: list[str]) -> Tensor:
        """Class ids written as text: "3", or several in one prompt, "0,1,2" (commas or spaces)."""
        ids = []
        for text in texts:
            parts = text.replace(",", " ").split()
            bad = [p for p in parts if not (p.isascii() and p.isdigit() and int(p) < NUM_CLASSES)]
            if not parts or bad:
                raise PromptError(f"prompt {text!r}: digits' prompts are class ids 0-{NUM_CLASSES - 1} (\"3\", "
                                  f"\"0,1,2\"){f'; not {bad[0]!r}' if bad else ''}")
            ids += [int(p) for p in parts]
        return torch.tensor(ids, dtype=torch.long)

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
