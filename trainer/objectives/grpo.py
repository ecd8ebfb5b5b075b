"""GRPO, the baseline (DDPO/Flow-GRPO style per-step PPO clip).

    A_i    = (r_i - mean_g r) / (std_g r + eps_std)                  group-relative advantage
    rho_t  = exp(log pi_theta(x_{t-1}|x_t) - log pi_old(x_{t-1}|x_t)) per-step ratio
    L      = E[ max(-A rho_t, -A clip(rho_t, 1 - eps_clip, 1 + eps_clip)) ] + beta * KL(pi_theta || pi_ref)
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rollout.batch import RolloutBatch
from trainer.advantages import group_advantages
from trainer.config import ObjectiveConfig
from trainer.objectives.registry import StepInputs, register


def ppo_clip_loss(ratio: Tensor, adv: Tensor, eps_clip: float) -> Tensor:
    """Per-sample -min(rho A, clip(rho, 1-eps, 1+eps) A)."""
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_clip, 1 + eps_clip))


def ratio_metrics(ratio: Tensor, log_ratio: Tensor, eps_clip: float) -> dict[str, Tensor]:
    r = ratio.detach()
    return {
        "policy/ratio_mean": r.mean(),
        "policy/ratio_std": r.std(unbiased=False),
        "policy/ratio_max": r.max(),
        "policy/clip_frac": ((r - 1).abs() > eps_clip).float().mean(),
        "policy/approx_kl_old": ((r - 1) - log_ratio.detach()).mean(),
    }


@register("grpo")
class GRPO:
    name = "grpo"

    def advantages(self, batch: RolloutBatch, cfg: ObjectiveConfig, state: dict[str, Any]) -> Tensor:
        adv = group_advantages(batch.train_reward(), batch.group, cfg.eps_std)
        return adv.clamp(-cfg.adv_clip, cfg.adv_clip)

    def loss(self, inputs: StepInputs, cfg: ObjectiveConfig, state: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = inputs.new_logp - inputs.old_logp
        ratio = log_ratio.exp()
        loss = ppo_clip_loss(ratio, inputs.advantages, cfg.eps_clip).mean()
        metrics = ratio_metrics(ratio, log_ratio, cfg.eps_clip)
        if inputs.kl_ref is not None and cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * inputs.kl_ref.mean()
            metrics["policy/kl_ref"] = inputs.kl_ref.detach().mean()
        metrics["policy/pg_loss"] = loss.detach()
        return loss, metrics
