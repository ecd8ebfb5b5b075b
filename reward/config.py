"""Reward settings and the factory that builds the named reward models.

`RewardConfig` is the digits testbed's classifier ensemble with its gold classifier; `ImageRewardConfig`
the text-to-image testbed's models (JPEG, CLIP score, aesthetic, preference, OCR), some of them monitor-only.
"""
from __future__ import annotations

from typing import Callable

import torch
from pydantic import Field, ValidationInfo, field_validator, model_validator
from rich.console import Console
from rich.table import Table
from torch import Tensor

from steadyrl.reward.base import RewardModel
from steadyrl.reward.classifiers import ClassifierSpec, DigitClassifierReward, load_classifier
from steadyrl.reward.ensemble_spec import EnsembleSpec
from steadyrl.reward.factory import PLUGIN_SPECS, JpegSpec, RewardSpec, build_reward_model
from steadyrl.reward.python_reward import named_score_columns
from steadyrl.reward.user_rewards import UserRewardSpec
from steadyrl.reward.weighting import WEIGHTED, RewardWeighting
from steadyrl.rollout.settings_base import StrictModel


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
    functions: list[UserRewardSpec] = Field(
        default_factory=list, description="your own rewards as members beside the classifiers: functions (kind "
        "python, reward/python_reward.py: called with the B images as uint8 arrays and their class ids), remote "
        "scorers (kind http, reward/http_reward.py) or an installed plug-in package's reward kinds "
        "(docs/bring-your-own-reward.md)")
    train_on: str = Field("cnn", description="member name, 'mean' for the ensemble mean, or 'weighted' (`weighting`)")
    feature_model: str = Field("cnn", description="member whose features measure diversity")
    weighting: RewardWeighting | None = Field(
        None, description="with train_on 'weighted': the members' weights (never the gold classifier's) and the "
        "normalisation mode, sum or per_reward (reward/weighting.py)")
    min_proxy_accuracy: float = Field(0.9, ge=0, le=1)
    min_gold_accuracy: float = Field(0.97, ge=0, le=1)

    def member_specs(self) -> list[RewardSpec]:
        """The ensemble members' specs, in column order (`reward.factory` builds each)."""
        return [*self.members, *([JpegSpec()] if self.jpeg else []), *self.functions]

    def ensemble_spec(self) -> EnsembleSpec:
        """The classifier ensemble with the gold classifier watching (its top-1 verdict is the accuracy)."""
        return EnsembleSpec(members=self.member_specs(), monitors=[self.gold], train_on=self.train_on,
                            feature_model=self.feature_model, correct=[self.gold.name], weighting=self.weighting)

    @field_validator("functions")
    @classmethod
    def _named_scores(cls, v: list[UserRewardSpec]) -> list[UserRewardSpec]:
        return named_score_columns(v)  # a function's `keys`: one column each

    @model_validator(mode="after")
    def _names(self) -> "RewardConfig":
        names = [m.name for m in self.member_specs()]
        if len(set(names)) != len(names) or self.gold.name in names:
            raise ValueError(f"reward model names must be unique (members {names}, gold {self.gold.name!r})")
        if self.gold.split != "gold" or any(m.split == "gold" for m in self.members):
            raise ValueError("the gold classifier must train on split 'gold' and no member may")
        check_weighting(self.train_on, self.weighting, names, [self.gold.name])
        if self.weighting is None and self.train_on != "mean" and self.train_on not in names:
            raise ValueError(f"train_on={self.train_on!r} must be 'mean', 'weighted' or one of {names}")
        if self.feature_model not in [m.name for m in self.members]:
            raise ValueError(f"feature_model={self.feature_model!r} must be a classifier member")
        return self


def check_weighting(train_on: str, weighting: RewardWeighting | None, trained: list[str], monitors: list[str]) -> None:
    """train_on 'weighted' and a weighting go together; the weights name trained models only."""
    if train_on == WEIGHTED and weighting is None:
        raise ValueError(f"reward.train_on={WEIGHTED!r} needs reward.weighting (the trained models' weights)")
    if weighting is not None and train_on != WEIGHTED:
        raise ValueError(f"reward.weighting is set but reward.train_on={train_on!r}: set train_on: {WEIGHTED} to "
                         "train on the weighted rewards")
    if weighting is not None:
        weighting.check_names(trained, monitors)


# the kinds that score images [B,3,H,W] given B prompts; a plug-in package's kinds are taken at their word
IMAGE_KINDS = ("jpeg", "clip_score", "aesthetic", "preference", "python", "http", "ocr", *PLUGIN_SPECS)
FEATURE_KINDS = ("clip_score", "aesthetic", "preference")  # CLIP-based: `features` are CLIP image embeddings


def _default_image_models() -> list[RewardSpec]:
    return [JpegSpec(upscale=1)]  # needs no download: a config without a reward section still runs


class ImageRewardConfig(StrictModel):
    """Reward models of a text-to-image testbed: each scores decoded images [B,3,H,W] in [-1, 1] against
    their B prompt strings. `monitor_only` models are scored and logged but never trained on (held-out
    monitors, the gold classifier's role in digits); the training reward is `train_on` over the others."""

    models: list[RewardSpec] = Field(
        default_factory=_default_image_models,
        description=f"the reward models (specs of kinds {', '.join(IMAGE_KINDS)}), with unique names; the "
        "default, one JPEG-compressibility model at upscale 1, needs no download")
    monitor_only: list[str] = Field(
        default_factory=list, description="names among `models` that are scored and logged but never trained on "
        "(held-out monitors); at least one model must remain trained")
    train_on: str = Field("mean", description="'mean' of the trained (not monitor-only) models, one trained "
                          "model's name, or 'weighted' (`weighting`)")
    feature_model: str | None = Field(
        None, description="a trained CLIP-based model (clip_score, aesthetic, preference) whose image embeddings "
        "feed the diversity metric; None: the first trained model that has features, else no features")
    weighting: RewardWeighting | None = Field(
        None, description="with train_on 'weighted': the trained models' weights (never a monitor-only model's) "
        "and the normalisation mode, sum or per_reward (reward/weighting.py)")

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[RewardSpec]) -> list[RewardSpec]:
        v = named_score_columns(v)  # a function's `keys`: one column each
        if not v:
            raise ValueError("reward.models: at least one reward model is needed")
        bad = [f"{m.name!r} (kind {m.kind!r})" for m in v if m.kind not in IMAGE_KINDS]
        if bad:
            raise ValueError(f"reward.models: {', '.join(bad)} cannot score text-to-image samples (images "
                             f"[B,3,H,W] with prompts); kinds must be among {list(IMAGE_KINDS)}")
        names = [m.name for m in v]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"reward.models: names must be unique, {repeated} appear more than once")
        return v

    @field_validator("monitor_only")
    @classmethod
    def _monitor_only(cls, v: list[str], info: ValidationInfo) -> list[str]:
        if "models" not in info.data:  # `models` itself failed: its error says why
            return v
        names = [m.name for m in info.data["models"]]
        unknown = [n for n in v if n not in names]
        if unknown:
            raise ValueError(f"reward.monitor_only: {unknown} are not among the models {names}")
        if len(set(v)) != len(v):
            raise ValueError(f"reward.monitor_only: names must not repeat, got {v}")
        if set(v) >= set(names):
            raise ValueError(f"reward.monitor_only: every model {names} is monitor-only; at least one must be "
                             "trained on")
        return v

    @field_validator("train_on")
    @classmethod
    def _train_on(cls, v: str, info: ValidationInfo) -> str:
        if "models" not in info.data or "monitor_only" not in info.data or v in ("mean", WEIGHTED):
            return v
        monitors = info.data["monitor_only"]
        trained = [m.name for m in info.data["models"] if m.name not in monitors]
        if v in monitors:
            raise ValueError(f"reward.train_on={v!r} is monitor-only (scored and logged, never trained on); "
                             f"train on 'mean' or one of {trained}")
        if v not in trained:
            raise ValueError(f"reward.train_on={v!r} must be 'mean' or one of the trained models {trained}")
        return v

    @field_validator("feature_model")
    @classmethod
    def _feature_model(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is None or "models" not in info.data or "monitor_only" not in info.data:
            return v
        kinds = {m.name: m.kind for m in info.data["models"]}
        if v not in kinds:
            raise ValueError(f"reward.feature_model={v!r} is not among the models {list(kinds)}")
        if kinds[v] not in FEATURE_KINDS:
            raise ValueError(f"reward.feature_model={v!r} (kind {kinds[v]!r}) has no image features; it must be "
                             f"a CLIP-based model (kinds {list(FEATURE_KINDS)})")
        if v in info.data["monitor_only"]:
            raise ValueError(f"reward.feature_model={v!r} is monitor-only: its embeddings feed diversity terms "
                             "that can enter the training signal (GARDO), so it must be a trained model")
        return v

    @model_validator(mode="after")
    def _weighting(self) -> "ImageRewardConfig":
        check_weighting(self.train_on, self.weighting, [m.name for m in self.trained_specs()], self.monitor_only)
        return self

    def model_names(self) -> list[str]:
        return [m.name for m in self.models]

    def trained_specs(self) -> list[RewardSpec]:
        """The models the training reward comes from (not monitor-only), in `models` order."""
        return [m for m in self.models if m.name not in self.monitor_only]

    def monitor_specs(self) -> list[RewardSpec]:
        """The monitor-only models, in `models` order."""
        return [m for m in self.models if m.name in self.monitor_only]

    def feature_model_name(self) -> str | None:
        """`feature_model`, or the first trained model with features (None if none has any)."""
        if self.feature_model is not None:
            return self.feature_model
        return next((m.name for m in self.trained_specs() if m.kind in FEATURE_KINDS), None)

    def ensemble_spec(self) -> EnsembleSpec:
        """The trained models as members, the monitor-only ones watching (no verdicts: scores only)."""
        return EnsembleSpec(members=self.trained_specs(), monitors=self.monitor_specs(), train_on=self.train_on,
                            feature_model=self.feature_model_name(), weighting=self.weighting)


def build_reward_models(cfg: RewardConfig) -> tuple[list[RewardModel], list[RewardModel], str]:
    """(members, monitors, feature model name); trains and caches classifiers that are missing.

    The training reward (the `train_on` member, every member for 'mean', the weighted ones for 'weighted') must reach
    `min_proxy_accuracy` on held-out real digits and the gold classifier `min_gold_accuracy`.
    """
    members: list[RewardModel] = [build_reward_model(spec) for spec in cfg.member_specs()]
    gold = build_reward_model(cfg.gold)
    proxies = [m for m in members if cfg.train_on in ("mean", m.name)
               or (cfg.weighting is not None and cfg.weighting.weights.get(m.name, 0.0) > 0)]
    checks = [(m, cfg.min_proxy_accuracy) for m in proxies if isinstance(m, DigitClassifierReward)]
    for m, need in checks + [(gold, cfg.min_gold_accuracy)]:
        if m.accuracy is not None and m.accuracy < need:
            raise RuntimeError(f"classifier {m.name!r} reached {m.accuracy:.3f} on held-out digits, "
                               f"below the required {need:.2f}")
    return members, [gold], cfg.feature_model


def differentiable_train_reward(cfg: RewardConfig) -> Callable[[Tensor, Tensor], Tensor]:
    """The training reward as a differentiable function (x_0, cond) -> [B], for reward back-propagation:
    the `train_on` classifier's probability of the requested digit, the mean over classifier members, or
    (train_on 'weighted') sum_k w_k r_k over the weighted members with the normalised weights w_k."""
    weights = cfg.weighting.normalised() if cfg.weighting is not None else None
    names = ([m.name for m in [*cfg.members, *cfg.functions]] if cfg.train_on == "mean" else
             list(weights) if weights is not None else [cfg.train_on])
    specs = [next(m for m in cfg.members if m.name == n) for n in names if any(m.name == n for m in cfg.members)]
    if len(specs) != len(names):  # 'jpeg_compressibility' has no gradient
        raise ValueError(f"reward.train_on={cfg.train_on!r}: reward back-propagation needs differentiable "
                         f"(classifier) rewards, got {names}")
    models = [load_classifier(spec) for spec in specs]
    for m in models:
        m.model.requires_grad_(False)

    def reward(samples: Tensor, cond: Tensor) -> Tensor:
        scores = torch.stack([m.differentiable_score(samples, cond) for m in models])
        if weights is None:
            return scores.mean(dim=0)
        w = torch.tensor([weights[n] for n in names], dtype=scores.dtype, device=scores.device)
        return (w[:, None] * scores).sum(dim=0)  # r = sum_k w_k r_k

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
