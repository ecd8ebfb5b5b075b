"""The learning-rate schedule over a run's updates (one update = one RL step's optimisation of its batch).

    constant   lr(u) = lr
    cosine     lr(u) = lr * (u + 1) / W                                                     u < W  (linear warm-up)
               lr(u) = lr * [m + (1 - m) * (1 + cos(pi * (u - W) / (T - W))) / 2]           W <= u < T
               lr(u) = lr * m                                                               u >= T

u: the update's index (0 first), W: `warmup_updates`, T: `total_updates` (the run's steps unless set), m:
`min_lr_ratio`. The learner sets it before each update from its update count, which its checkpoint keeps, so a
resumed run continues the same schedule. A warm-up also applies to `constant` (lr after W updates).
"""
from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from steadyrl.rollout.settings_base import StrictModel


class LRScheduleConfig(StrictModel):
    kind: Literal["constant", "cosine"] = Field(
        "constant", description="constant, or cosine decay to min_lr_ratio * lr over total_updates (late updates "
        "then move a nearly converged policy less, where reward hacking and collapse start)")
    warmup_updates: int = Field(0, ge=0, description="updates whose lr rises linearly to learner.lr: Adam's first "
                                "steps, before its moment estimates settle, are the largest")
    total_updates: int | None = Field(None, ge=1, description="the update where the cosine reaches its floor; None: "
                                      "the run's steps (run.steps)")
    min_lr_ratio: float = Field(0.1, ge=0, le=1, description="the cosine's floor, as a fraction of learner.lr")

    @model_validator(mode="after")
    def _warmup_within_total(self) -> "LRScheduleConfig":
        if self.total_updates is not None and self.kind == "cosine" and self.warmup_updates >= self.total_updates:
            raise ValueError(f"learner.lr_schedule.warmup_updates={self.warmup_updates} must be less than "
                             f"total_updates={self.total_updates}")
        return self


def lr_factor(cfg: LRScheduleConfig, update: int) -> float:
    """lr(u) / lr for update index `update` (see the module docstring)."""
    W = cfg.warmup_updates
    if update < W:
        return (update + 1) / W
    if cfg.kind == "constant":
        return 1.0
    T = cfg.total_updates
    if T is None:
        raise ValueError("learner.lr_schedule.total_updates is unset (the run config fills it from run.steps)")
    if update >= T:
        return cfg.min_lr_ratio
    m = cfg.min_lr_ratio
    return m + (1 - m) * 0.5 * (1 + math.cos(math.pi * (update - W) / (T - W)))
