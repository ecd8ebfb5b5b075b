"""Reward settings and the factory that builds the named reward models."""
from __future__ import annotations

from typing import Callable

import torch
from pydantic import Field, model_validator
from rich.console import Console
from rich.table import Table
from torch import Tensor

from reward.base import RewardModel
from reward.classifiers import ClassifierSpec, DigitClassifierReward, load_classifier
from reward.factory import JpegSpec, build_reward_model
from rollout.config import StrictModel


def _default_members() -> list[ClassifierSpec]:
    return [
        ClassifierSpec(name="cnn", arch="cnn", seed=1, epochs=40),
        ClassifierSpec(name="mlp", arch="mlp", seed=2, epochs=60),
        ClassifierSpec(name="linear", arch="linear", seed=3, epochs=60),
    ]


def _default_gold() -> ClassifierSpec:
    return ClassifierSpec(name="gold", arch="wide_cnn", split="gold", subset_fraction=1.0, seed=4, epochs=60,
                          augment=True)


class RewardConfig(StrictModel):
    """Which reward trains the policy (`train_on`) and which models only watch (`gold`)."""

    members: list[ClassifierSpec] = Field(default_factory=_default_members)
    gold: ClassifierSpec = Field(default_factory=_default_gold)
    jpeg: bool = Field(False, description="add the JPEG-compressibility reward as a member")
    train_on: str = Field("cnn", description="member name, or 'mean' for the ensemble mean")
    feature_model: str = Field("cnn", description="member whose features measure diversity")
    min_proxy_accuracy: float = Field(0.9, ge=0, le=1)
    min_gold_accuracy: float = Field(0.97, ge=0, le=1)

    def member_specs(self) -> list[ClassifierSpec | JpegSpec]:
        """The ensemble members' specs, in column order (`reward.factory` builds each)."""
        return [*self.members, *([JpegSpec()] if self.jpeg else [])]

    @model_validator(mode="after")
    def _names(self) -> "RewardConfig":
        names = [m.name for m in self.member_specs()]
        if len(set(names)) != len(names) or self.gold.name in names:
            raise ValueError(f"reward model names must be unique (members {names}, gold {self.gold.name!r})")
        if self.gold.split != "gold" or any(m.split == "gold" for m in self.members):
            raise ValueError("the gold classifier must train on split 'gold' and no member may")
        if self.train_on != "mean" and self.train_on not in names:
            raise ValueError(f"train_on={self.train_on!r} must be 'mean' or one of {names}")
        if self.feature_model not in [m.name for m in self.members]:
            raise ValueError(f"feature_model={self.feature_model!r} must be a classifier member")
        return self


def build_reward_models(cfg: RewardConfig) -> tuple[list[RewardModel], list[RewardModel], str]:
    """(members, monitors, feature model name); trains and caches classifiers that are missing.

    The training reward (the `train_on` member, or every member for 'mean') must reach
    `min_proxy_accuracy` on held-out real digits and the gold classifier `min_gold_accuracy`.
    """
    members: list[RewardModel] = [build_reward_model(spec) for spec in cfg.member_specs()]
    gold = build_reward_model(cfg.gold)
    proxies = [m for m in members if cfg.train_on in ("mean", m.name)]
    checks = [(m, cfg.min_proxy_accuracy) for m in proxies if isinstance(m, DigitClassifierReward)]
    for m, need in checks + [(gold, cfg.min_gold_accuracy)]:
        if m.accuracy is not None and m.accuracy < need:
            raise RuntimeError(f"classifier {m.name!r} reached {m.accuracy:.3f} on held-out digits, "
                               f"below the required {need:.2f}")
    return members, [gold], cfg.feature_model


def differentiable_train_reward(cfg: RewardConfig) -> Callable[[Tensor, Tensor], Tensor]:
    """The training reward as a differentiable function (x_0, cond) -> [B], for reward back-propagation:
    the `train_on` classifier's probability of the requested digit, or the mean over classifier members."""
    names = [m.name for m in cfg.members] if cfg.train_on == "mean" else [cfg.train_on]
    specs = [m for m in cfg.members if m.name in names]
    if len(specs) != len(names):  # 'jpeg_compressibility' has no gradient
        raise ValueError(f"reward.train_on={cfg.train_on!r}: reward back-propagation needs differentiable "
                         f"(classifier) rewards, got {names}")
    models = [load_classifier(spec) for spec in specs]
    for m in models:
        m.model.requires_grad_(False)

    def reward(samples: Tensor, cond: Tensor) -> Tensor:
        return torch.stack([m.differentiable_score(samples, cond) for m in models]).mean(dim=0)

    return reward


def accuracy_table(members: list[RewardModel], monitors: list[RewardModel]) -> Table:
    table = Table(title="reward classifiers (held-out real digits)")
    table.add_column("model")
    table.add_column("role")
    table.add_column("test accuracy", justify="right")
    roles = [(m, "ensemble member") for m in members] + [(m, "gold monitor (never trained on)") for m in monitors]
    for m, role in roles:
        acc = getattr(m, "accuracy", None)
        table.add_row(m.name, role, "-" if acc is None else f"{acc:.1%}")
    return table


def print_accuracies(members: list[RewardModel], monitors: list[RewardModel], console: Console | None = None) -> None:
    (console or Console()).print(accuracy_table(members, monitors))
