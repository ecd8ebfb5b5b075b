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


def check_scores(name: str, scores: Tensor, batch: int) -> Tensor:
    """Reject wrong shapes and non-finite rewards with an error naming the model."""
    if scores.shape != (batch,):
        raise ValueError(f"reward model {name!r} returned shape {tuple(scores.shape)}, expected ({batch},)")
    bad = ~scores.isfinite()
    if bool(bad.any()):
        raise ValueError(f"reward model {name!r} returned {int(bad.sum())} non-finite scores")
    return scores
