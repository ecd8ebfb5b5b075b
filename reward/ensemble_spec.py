"""A testbed's reward ensemble as data: which models score, which only watch, how scores combine.

The same spec builds the in-process `RewardEnsemble` (`build`, the local runtime and `steadyrl eval`) and
the Serve application (`services.serving.app`, one deployment per model), so the two score alike: the same
models from the same factory, the same training column, and one rule for the 0/1 verdicts:

    monitors[<name>_correct] = model.correct(samples, cond)   for each monitor named in `correct`
"""
from __future__ import annotations

from pydantic import Field, model_validator

from steadyrl.reward.ensemble import RewardEnsemble
from steadyrl.reward.factory import RewardSpec, build_reward_model
from steadyrl.reward.weighting import WEIGHTED, RewardWeighting
from steadyrl.rollout.settings_base import StrictModel


class EnsembleSpec(StrictModel):
    """Members (their scores, mean, spread and rank disagreement), monitors (scored, never trained on), the
    training column, the member whose features measure diversity, and the monitors that give a verdict."""

    members: list[RewardSpec] = Field(min_length=1, description="the ensemble's models, in column order")
    monitors: list[RewardSpec] = Field(default_factory=list, description="scored and logged, never the reward")
    train_on: str = Field(description="a member's name, 'mean' of the members, or 'weighted' (`weighting`)")
    feature_model: str | None = Field(None, description="a member whose `features` measure diversity")
    correct: list[str] = Field(default_factory=list, description="monitors whose 0/1 verdict (`correct`) is "
                               "reported as `<name>_correct` (a gold classifier's top-1, a verifier's exact match)")
    weighting: RewardWeighting | None = Field(
        None, description="train_on 'weighted': the members' weights and normalisation (reward/weighting.py)")

    @model_validator(mode="after")
    def _names(self) -> "EnsembleSpec":
        members, monitors = self.member_names(), [m.name for m in self.monitors]
        if len(set(members + monitors)) != len(members + monitors):
            raise ValueError(f"reward model names must be unique (members {members}, monitors {monitors})")
        if (self.train_on == WEIGHTED) != (self.weighting is not None):
            raise ValueError(f"train_on={self.train_on!r} and weighting={self.weighting}: train_on 'weighted' and a "
                             "weighting go together")
        if self.weighting is not None:
            self.weighting.check_names(members, monitors)
        elif self.train_on != "mean" and self.train_on not in members:
            raise ValueError(f"train_on={self.train_on!r} must be 'mean' or one of the members {members}")
        if self.feature_model is not None and self.feature_model not in members:
            raise ValueError(f"feature_model={self.feature_model!r} must be one of the members {members}")
        if not set(self.correct) <= set(monitors):
            raise ValueError(f"correct={self.correct} must name monitors (of {monitors})")
        return self

    def member_names(self) -> list[str]:
        return [m.name for m in self.members]

    def build(self) -> RewardEnsemble:
        """The ensemble in this process, each model from `reward.factory` as a Serve deployment builds it."""
        members = [build_reward_model(spec) for spec in self.members]
        monitors = [build_reward_model(spec) for spec in self.monitors]
        feature = None if self.feature_model is None else members[self.member_names().index(self.feature_model)]
        return RewardEnsemble(members, self.train_on, monitors, feature, correct=self.correct,
                              weighting=self.weighting)
