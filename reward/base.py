"""The one interface every reward model implements."""
from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor


@runtime_checkable
class RewardModel(Protocol):
    """`score(samples [B,...], cond) -> [B]`; higher is better. `cond` is the conditioning of the B samples:
    class ids [B] (digits), or a list of B prompt strings (text-to-image rewards, reward/clip_models.py).
    `features(samples) -> [B,D]` is optional."""

    name: str

    def score(self, samples: Tensor, cond: Tensor) -> Tensor: ...

    def health_probe(self) -> tuple[Tensor, Tensor | list[str]] | None:
        """(samples, cond) of one input that `score` of a sound model scores finitely; None: nothing to probe."""


@runtime_checkable
class GroupwiseRewardModel(RewardModel, Protocol):
    """A reward model that scores whole prompt groups: `score_groups(samples, cond, group [B] | None) -> [B]`
    (None: the batch is one group), e.g. a rank within the group."""

    def score_groups(self, samples: Tensor, cond: Tensor, group: Tensor | None) -> Tensor: ...


def score_model(model: RewardModel, samples: Tensor, cond: Tensor, group: Tensor | None = None) -> Tensor:
    """One model's scores [B], checked: a groupwise model sees the prompt groups, any other scores per sample."""
    if isinstance(model, GroupwiseRewardModel):
        return check_scores(model.name, model.score_groups(samples, cond, group), samples.shape[0])
    return check_scores(model.name, model.score(samples, cond), samples.shape[0])


def check_scores(name: str, scores: Tensor, batch: int) -> Tensor:
    """Reject wrong shapes and non-finite rewards with an error naming the model."""
    if scores.shape != (batch,):
        raise ValueError(f"reward model {name!r} returned shape {tuple(scores.shape)}, expected ({batch},)")
    bad = ~scores.isfinite()
    if bool(bad.any()):
        raise ValueError(f"reward model {name!r} returned {int(bad.sum())} non-finite scores")
    return scores
