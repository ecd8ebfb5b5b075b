"""Weighted multi-reward training: several trained reward models with weights, and how they combine.

A testbed's reward section sets `train_on: weighted` and a `weighting` (this model); the ensemble then adds
the training column `weighted` and the batch carries the weighting (`batch.meta[WEIGHTING_KEY]`) to the
learner, whose one advantage seam (trainer/advantages.py) reads it:

    w_k   = c_k / sum_j c_j                     the configured weights c_k >= 0, normalised to sum 1
    r_i   = sum_k w_k r_k,i                     the `weighted` column (both modes: logged, GARDO's proxy)
    sum:        A_i = the objective's own advantage of r_i (GRPO: (r_i - mean_g r) / (std_g r + eps_std))
    per_reward: z_k,i = (r_k,i - mean_g r_k) / (std_g r_k + eps_std)   each reward within its prompt group g
                A_i   = sum_k w_k z_k,i                                  (population std; `eps_std` below)

Weights are normalised to sum 1, so 7:3, 0.7:0.3 and 70:30 train alike and `r` stays on its members' scale
(the objective's clip thresholds and KL weights mean the same as with one reward).
"""
from __future__ import annotations

import math
from typing import Literal, Sequence

import torch
from pydantic import Field, field_validator
from torch import Tensor

from steadyrl.rollout.settings_base import StrictModel

WEIGHTED = "weighted"  # the `train_on` value and the training column's name
WEIGHTING_KEY = "reward_weighting"  # batch.meta: the RewardWeighting the batch's rewards were combined with


class RewardWeighting(StrictModel):
    """Weights over the trained reward models and how their advantages combine (module docstring)."""

    weights: dict[str, float] = Field(
        min_length=1, description="{member name: weight >= 0}; normalised to sum 1 (7:3 = 0.7:0.3); members left "
        "out weigh 0; monitors (never trained on) cannot be weighted")
    normalise: Literal["sum", "per_reward"] = Field(
        "sum", description="sum: r = sum_k w_k r_k, then the objective's own group normalisation; per_reward: each "
        "reward normalised within its prompt group, A = sum_k w_k (r_k - mean_g r_k) / (std_g r_k + eps_std), so a "
        "reward with a small spread still moves the policy in proportion to its weight")
    eps_std: float = Field(1e-4, gt=0, description="per_reward only: the epsilon of each reward's group std "
                           "(the objective's own eps_std is not used in that mode)")

    @field_validator("weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: w for k, w in v.items() if not math.isfinite(w) or w < 0}
        if bad:
            raise ValueError(f"reward.weighting.weights: weights must be finite and >= 0, got {bad}")
        if sum(v.values()) <= 0:
            raise ValueError(f"reward.weighting.weights: at least one weight must be > 0, got {v}")
        return v

    def normalised(self) -> dict[str, float]:
        """w_k = c_k / sum_j c_j, in the configured order."""
        total = sum(self.weights.values())
        return {k: c / total for k, c in self.weights.items()}

    def check_names(self, trained: Sequence[str], monitors: Sequence[str] = ()) -> None:
        """Every weighted name is a trained member (not a monitor, not unknown)."""
        on_monitors = [k for k in self.weights if k in monitors]
        if on_monitors:
            raise ValueError(f"reward.weighting.weights: {on_monitors} are monitors (scored and logged, never trained "
                             f"on) and cannot be weighted; weight the trained models {list(trained)}")
        unknown = [k for k in self.weights if k not in trained]
        if unknown:
            raise ValueError(f"reward.weighting.weights: {unknown} are not trained reward models; weight among "
                             f"{list(trained)}")
        if WEIGHTED in trained:
            raise ValueError(f"reward.weighting: a reward model may not be named {WEIGHTED!r} (the weighted column)")

    def combine(self, names: Sequence[str], scores: Tensor) -> Tensor:
        """r_i = sum_k w_k r_k,i over the weighted columns of scores [B, K] (columns in `names` order); a weight-0
        column is left out, so its NaN does not void the sample."""
        names = list(names)
        missing = [k for k in self.weights if k not in names]
        if missing:
            raise ValueError(f"reward.weighting.weights: {missing} are not among the scored members {names}")
        out = torch.zeros(scores.shape[0], dtype=scores.dtype, device=scores.device)
        for k, w in self.normalised().items():
            if w > 0:
                out = out + w * scores[:, names.index(k)]
        return out
