"""The KL weight's schedule over a run's updates: a factor on the objective's `kl_coef` (0 stays 0).

    constant   f(u) = 1
    linear     f(u) = 1 + (e - 1) * min(u / T, 1)
    cosine     f(u) = e + (1 - e) * (1 + cos(pi * min(u / T, 1))) / 2

u: the update's index (0 first), T: `total_updates` (the run's steps unless set), e: `end_ratio` (the factor from
update T on). A rising KL weight (e > 1) tightens the policy to its reference as a run matures, where reward hacking
starts; a falling one (e < 1) lets a run explore late. The learner sets `objective.kl_scale` before each update from
its update count (kept in its checkpoint), and logs the weight used as `policy/kl_weight`.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from steadyrl.rollout.config import StrictModel


class KLScheduleConfig(StrictModel):
    kind: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="how the KL weight moves from objective.kl_coef to end_ratio x kl_coef over "
        "total_updates")
    end_ratio: float = Field(1.0, ge=0, description="the factor on kl_coef from update total_updates on")
    total_updates: int | None = Field(None, ge=1, description="updates the schedule spans; None: the run's steps")


def kl_factor(cfg: KLScheduleConfig, update: int) -> float:
    """f(u) (see the module docstring)."""
    if cfg.kind == "constant":
        return 1.0
    if cfg.total_updates is None:
        raise ValueError("learner.kl_schedule.total_updates is unset (the run config fills it from run.steps)")
    frac, e = min(update / cfg.total_updates, 1.0), cfg.end_ratio
    if cfg.kind == "linear":
        return 1.0 + (e - 1.0) * frac
    return e + (1.0 - e) * 0.5 * (1.0 + math.cos(math.pi * frac))
