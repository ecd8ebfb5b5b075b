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


@runtime_checkable
class TextItemsModel(Protocol):
    """A reward model that also scores text or token-id items (the arith REST route): (scores, 0/1 or scores)."""

    name: str

    def score_items(self, prompts: list, completions: list) -> tuple[Tensor, Tensor]: ...


class UserRewardModel:
    """A reward model whose scores come from the user's code (a function, a remote scorer). A sample it cannot
    score may come back non-finite: it is kept as NaN, and the learner skips it and counts it
    (`reward/nonfinite_skipped`) when it is in the training reward. A built-in model's non-finite score is a bug
    and fails the step."""


def score_model(model: RewardModel, samples: Tensor, cond: Tensor, group: Tensor | None = None) -> Tensor:
    """One model's scores [B], checked: a groupwise model sees the prompt groups, any other scores per sample."""
    if isinstance(model, GroupwiseRewardModel):
        return check_scores(model, model.score_groups(samples, cond, group), samples.shape[0])
    return check_scores(model, model.score(samples, cond), samples.shape[0])


def check_scores(model: RewardModel, scores: Tensor, batch: int) -> Tensor:
    """Reject wrong shapes with an error naming the model; non-finite scores too, except a `UserRewardModel`'s,
    which come back as NaN (+-inf included: a sample it could not score, not a very good or bad one)."""
    if scores.shape != (batch,):
        raise ValueError(f"reward model {model.name!r} returned shape {tuple(scores.shape)}, expected ({batch},)")
    bad = ~scores.isfinite()
    if not bool(bad.any()):
        return scores
    if isinstance(model, UserRewardModel):
        return scores.masked_fill(bad, float("nan"))
    raise ValueError(f"reward model {model.name!r} returned {int(bad.sum())} non-finite scores")
