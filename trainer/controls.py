"""What the controller may change about one update from the run's health (`services.driver.run_health`)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UpdateControls:
    """lr = learner.lr x lr_schedule(u) x lr_scale;  KL weight = kl_coef x kl_schedule(u) x kl_boost.

    lr_scale: lowered by each collapse rollback; kl_boost: raised while a reward-hacking event is answered."""

    lr_scale: float = 1.0
    kl_boost: float = 1.0
