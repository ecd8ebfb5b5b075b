"""One reward-model factory: a spec in, a `RewardModel` out.

The in-process ensemble (`reward.config.build_reward_models`, the testbeds' `reward_ensemble`) and every
Serve reward deployment (`services.reward_app`) build their models here, from the same specs, so a
model scores the same whether it runs in a benchmark or behind REST. A spec's `kind` picks the model:

    classifier   a digits classifier trained and cached by config (reward/classifiers.py)
    jpeg         JPEG compressibility, -(size in kB) (reward/jpeg.py)
    verifier     an exact arith verifier over text or token ids (reward/verifiers.py)
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter

from reward.base import RewardModel
from reward.classifiers import ClassifierSpec
from reward.verifiers import VerifierSpec
from rollout.config import StrictModel


class JpegSpec(StrictModel):
    kind: Literal["jpeg"] = "jpeg"
    name: str = "jpeg_compressibility"
    quality: int = Field(95, ge=1, le=100)


RewardSpec = Annotated[
    Union[Annotated[ClassifierSpec, Tag("classifier")], Annotated[JpegSpec, Tag("jpeg")],
          Annotated[VerifierSpec, Tag("verifier")]],
    Discriminator("kind"),
]
_SPEC = TypeAdapter(RewardSpec)


def parse_reward_spec(data: dict[str, Any] | RewardSpec) -> RewardSpec:
    """A spec from its JSON form (as it travels to a Serve deployment); errors name the field."""
    return _SPEC.validate_python(data)


def build_reward_model(spec: RewardSpec | dict[str, Any]) -> RewardModel:
    """The reward model a spec describes (classifiers are trained and cached on first use)."""
    spec = parse_reward_spec(spec) if isinstance(spec, dict) else spec
    if isinstance(spec, ClassifierSpec):
        from reward.classifiers import load_classifier

        return load_classifier(spec)
    if isinstance(spec, JpegSpec):
        from reward.jpeg import JpegCompressibilityReward

        return JpegCompressibilityReward(quality=spec.quality, name=spec.name)
    if isinstance(spec, VerifierSpec):
        from reward.verifiers import VerifierReward

        return VerifierReward.from_spec(spec)
    raise ValueError(f"unknown reward model spec {spec!r}")
