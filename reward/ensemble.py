"""Reward ensembles: per-model scores, their mean and spread, and a rank-disagreement uncertainty.

Uncertainty of sample i (within its group g of size n):
    q_ik = rank_k(i within g) / (n - 1)            normalised rank of i under model k, in [0, 1]
    u_i  = std_k q_ik                               (population std over the K models)
0 when every model orders the group the same way; large when they disagree about i.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor

from steadyrl.reward.base import RewardModel, score_model
from steadyrl.reward.weighting import WEIGHTED, WEIGHTING_KEY, RewardWeighting
from steadyrl.rollout.batch import RolloutBatch


@dataclass
class EnsembleScores:
    """Scores of one batch. `reward` is the training reward (`train_on`: a member name, 'mean', or 'weighted':
    sum_k w_k r_k with the `weighting`'s normalised weights)."""

    names: list[str]
    scores: Tensor  # [B,K]
    mean: Tensor  # [B]
    std: Tensor  # [B]
    uncertainty: Tensor  # [B]
    reward: Tensor  # [B]
    train_on: str
    monitors: dict[str, Tensor] = field(default_factory=dict)  # never used for training
    features: Tensor | None = None
    weighting: RewardWeighting | None = None


def finite_mean(x: Tensor) -> float:
    """The mean of the finite entries (NaN if none): a user's reward that could not score a sample (NaN) leaves
    the logged means over the rest; with every entry finite this is `x.mean()`, bit for bit."""
    finite = x.isfinite()
    return float(x.mean() if bool(finite.all()) else x[finite].mean())


def normalised_ranks(scores: Tensor, group: Tensor) -> Tensor:
    """[B,K] ranks of each sample within its group under each model, scaled to [0, 1]."""
    out = torch.zeros_like(scores, dtype=torch.float64)
    for g in group.unique():
        idx = torch.nonzero(group == g).flatten()
        if len(idx) < 2:
            continue
        ranks = scores[idx].argsort(dim=0, stable=True).argsort(dim=0, stable=True).double()  # ties: index order
        out[idx] = ranks / (len(idx) - 1)
    return out


def rank_disagreement(scores: Tensor, group: Tensor | None = None) -> Tensor:
    """u_i = std over models of sample i's normalised rank in its group ([B]); one group if None."""
    if group is None:
        group = torch.zeros(scores.shape[0], dtype=torch.long)
    return normalised_ranks(scores, group).std(dim=1, unbiased=False).to(scores.dtype)


def combine_scores(
    names: Sequence[str], scores: Tensor, group: Tensor | None, train_on: str,
    weighting: RewardWeighting | None = None,
) -> EnsembleScores:
    """Mean, spread, uncertainty and the training reward from per-model scores [B,K] (train_on 'weighted':
    r = sum_k w_k r_k, `weighting.combine`)."""
    names = list(names)
    if (train_on == WEIGHTED) != (weighting is not None):
        raise ValueError(f"train_on={train_on!r}: train_on 'weighted' and a weighting go together")
    if train_on not in ("mean", WEIGHTED) and train_on not in names:
        raise ValueError(f"train_on={train_on!r} is neither 'mean' nor one of the members {names}")
    mean = scores.mean(dim=1)
    if weighting is not None:
        reward = weighting.combine(names, scores)
    else:
        reward = mean if train_on == "mean" else scores[:, names.index(train_on)]
    return EnsembleScores(
        names=names, scores=scores, mean=mean, std=scores.std(dim=1, unbiased=False),
        uncertainty=rank_disagreement(scores, group), reward=reward, train_on=train_on, weighting=weighting,
    )


class RewardEnsemble:
    """In-process ensemble; the Ray Serve application composes the same pieces over deployments."""

    def __init__(
        self,
        members: Sequence[RewardModel],
        train_on: str,
        monitors: Sequence[RewardModel] = (),
        feature_model: RewardModel | None = None,
        correct: Sequence[str] = (),
        weighting: RewardWeighting | None = None,
    ):
        """`correct`: the monitors whose 0/1 verdict is reported as `<name>_correct` (`monitor_scores`);
        `weighting`: the members' weights when `train_on` is 'weighted'."""
        if not members:
            raise ValueError("an ensemble needs at least one member")
        self.members = list(members)
        self.monitors = list(monitors)
        self.correct = tuple(correct)
        self.train_on = train_on
        self.weighting = weighting
        self.feature_model = feature_model
        self.name = "ensemble"

    def score_all(self, samples: Tensor, cond: Tensor, group: Tensor | None = None) -> EnsembleScores:
        cols = [score_model(m, samples, cond, group) for m in self.members]
        out = combine_scores([m.name for m in self.members], torch.stack(cols, dim=1), group, self.train_on,
                             self.weighting)
        out.monitors = monitor_scores(self.monitors, samples, cond, self.correct, group)
        if self.feature_model is not None:
            out.features = self.feature_model.features(samples)  # type: ignore[attr-defined]
        return out

    def score(self, samples: Tensor, cond: Tensor) -> Tensor:
        return self.score_all(samples, cond).reward


def monitor_scores(monitors: Sequence[RewardModel], samples: Tensor, cond: Tensor,
                   correct: Sequence[str] = (), group: Tensor | None = None) -> dict[str, Tensor]:
    """Scores of monitor-only models, and the 0/1 verdict `<name>_correct` of those named in `correct` (a
    classifier's top-1, a verifier's exact match): the Serve ingress applies the same rule."""
    out: dict[str, Tensor] = {}
    for m in monitors:
        out[m.name] = score_model(m, samples, cond, group)
        if m.name in correct:
            out[f"{m.name}_correct"] = m.correct(samples, cond)  # type: ignore[attr-defined]
    return out


def attach_scores(batch: RolloutBatch, scores: EnsembleScores) -> RolloutBatch:
    """The batch with its rewards (every member's column plus `mean`, and `weighted` under a weighting, whose
    settings then travel in `batch.meta` for the learner's advantages; `train_on` is the training column),
    uncertainty and features filled in from the ensemble's scores."""
    rewards = torch.cat([scores.scores, scores.mean[:, None]], dim=1)
    names, meta = scores.names + ["mean"], batch.meta
    if scores.weighting is not None:
        rewards = torch.cat([rewards, scores.reward[:, None]], dim=1)
        names, meta = names + [WEIGHTED], {**meta, WEIGHTING_KEY: scores.weighting}
    return batch.replace(rewards=rewards, reward_names=names, reward_key=scores.train_on, meta=meta,
                         uncertainty=scores.uncertainty, features=scores.features)
