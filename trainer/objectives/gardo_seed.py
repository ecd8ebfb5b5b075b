"""GARDO, seed form (`gardo.seed`): a Kendall-tau gate and an EMA reference.

Gate (reward/uncertainty.py): over the whole batch S of n samples, with the proxy reward and each
auxiliary reward k (every column but `reward_key` and "mean"),

    g_i    = (n - 2)/2 * mean_k [ tau_b^k(S minus i) - tau_b^k(S) ]     leave-one-out change in agreement
    gate_i = g_i > delta                                                 (seed: delta in [0.1, 0.3])

Without ties g_i = tau - tau_i, with tau_i = (c_i - d_i)/(n - 1) sample i's own Kendall agreement
between the proxy and the auxiliaries: a sample is gated when its pairs agree less than the batch's
pairs do by more than delta (removing it raises the mean tau by more than 2 delta/(n - 2)).

Advantage and loss are those of `gardo.paper` (trainer/objectives/gardo.py): the diversity-aware
advantage, PPO clip on every sample, KL to the reference on the gated samples only. After each update
the reference follows the policy by EMA: ref <- alpha ref + (1 - alpha) policy (alpha = 0.99); no hard
resets.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.reward.uncertainty import kendall_gate_score
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.objectives.base import LearnerHooks
from steadyrl.trainer.objectives.gardo import GARDOBase, GARDOCommonSettings, aux_scores
from steadyrl.trainer.objectives.registry import register


class GARDOSeedSettings(GARDOCommonSettings):
    name: Literal["gardo.seed"] = "gardo.seed"
    kendall_delta: float = Field(0.2, ge=0, le=2, description="gate when g_i > delta (seed range 0.1-0.3)")
    ema_decay: float = Field(0.99, ge=0, lt=1, description="reference EMA decay alpha")


@register("gardo.seed")
class GARDOSeed(GARDOBase):
    Settings = GARDOSeedSettings

    def __init__(self, cfg: GARDOSeedSettings):
        super().__init__(cfg)
        self.state = {"ema_updates": torch.tensor(0)}

    def gate(self, batch: RolloutBatch) -> tuple[Tensor, dict[str, float]]:
        g = kendall_gate_score(batch.train_reward(), aux_scores(batch))
        return g > self.cfg.kendall_delta, {"gardo/u_mean": float(g.mean()), "gardo/u_max": float(g.max())}

    def after_update(self, hooks: LearnerHooks, metrics: dict[str, float]) -> dict[str, float]:
        kl = self.window.take_max()
        hooks.ema_reference(self.cfg.ema_decay)
        self.state["ema_updates"] = self.state["ema_updates"] + 1
        return {"gardo/kl_window_max": kl, "gardo/ema_decay": self.cfg.ema_decay,
                "gardo/resets": 0.0}
