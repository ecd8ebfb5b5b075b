"""The KL weight's schedule over a run's updates: a factor on the objective's `kl_coef` (0 stays 0).

    constant   f(u) = 1
    linear     f(u) = 1 + (e - 1) * min(u / T, 1)
    cosine     f(u) = e + (1 - e) * (1 + cos(pi * min(u / T, 1))) / 2
    periodic   f(u) = e + (1 - e) * (1 + cos(2 pi * u / P)) / 2

u: the update's index (0 first), T: `total_updates` (the run's steps unless set), e: `end_ratio` (the factor from
update T on; for `periodic` the trough of each cycle), P: `period`. `periodic` is our reading of the GARDO seed's
"periodic" KL weight (the seed gives no formula): the weight cycles from kl_coef down to e x kl_coef and back every P
updates, so a run alternates between exploring and being pulled back to its reference, as GARDO's periodically
reset reference does.

A rising KL weight (e > 1) tightens the policy to its reference as a run matures, where reward hacking starts; a
falling one (e < 1) lets a run explore late. The learner gives the objective its factor at the start of each update
(`Objective.begin_update`) from its update count (kept in its checkpoint) times the controller's `kl_boost` (health.anomaly), and logs the
weight used as `policy/kl_weight`.
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from steadyrl.rollout.settings_base import StrictModel


class KLScheduleConfig(StrictModel):
    kind: Literal["constant", "linear", "cosine", "periodic"] = Field(
        "constant", description="how the KL weight moves from objective.kl_coef to end_ratio x kl_coef over "
        "total_updates (periodic: down to end_ratio x kl_coef and back every `period` updates)")
    end_ratio: float = Field(1.0, ge=0, description="the factor on kl_coef from update total_updates on (periodic: "
                             "at the middle of each cycle)")
    total_updates: int | None = Field(None, ge=1, description="updates the schedule spans; None: the run's steps")
    period: int | None = Field(None, ge=2, description="updates per cycle of the periodic schedule (required for "
                               "kind=periodic, refused otherwise)")

    @model_validator(mode="after")
    def _period_for_periodic(self) -> "KLScheduleConfig":
        if (self.kind == "periodic") != (self.period is not None):
            raise ValueError("learner.kl_schedule.period is required for kind=periodic and only for it "
                             f"(kind={self.kind!r}, period={self.period})")
        return self


def kl_factor(cfg: KLScheduleConfig, update: int) -> float:
    """f(u) (see the module docstring)."""
    if cfg.kind == "constant":
        return 1.0
    if cfg.kind == "periodic":
        return cfg.end_ratio + (1.0 - cfg.end_ratio) * 0.5 * (1.0 + math.cos(2.0 * math.pi * update / cfg.period))
    if cfg.total_updates is None:
        raise ValueError("learner.kl_schedule.total_updates is unset (the run config fills it from run.steps)")
    frac, e = min(update / cfg.total_updates, 1.0), cfg.end_ratio
    if cfg.kind == "linear":
        return 1.0 + (e - 1.0) * frac
    return e + (1.0 - e) * 0.5 * (1.0 + math.cos(math.pi * frac))
