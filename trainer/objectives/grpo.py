"""GRPO, the baseline (DDPO/Flow-GRPO style per-step PPO clip).

    A_i    = (r_i - mean_g r) / (std_g r + eps_std)                  group-relative advantage
    rho_t  = exp(log pi_theta(x_{t-1}|x_t) - log pi_old(x_{t-1}|x_t)) per-step ratio
    L      = E_{i,t}[ max(-A_i rho_t, -A_i clip(rho_t, 1 - eps_clip, 1 + eps_clip)) ] + beta * E KL(pi_theta || pi_ref)

Normaliser: each piece returns sum_{terms in piece} ppo_clip / n_terms + kl_coef * sum KL / n_terms, with
n_terms = samples in the optimisation step (all ranks) x trained steps drawn per sample; on a dLLM (sequence
ratio, one term per sequence) n_terms = sequences in the step. The pieces sum to the mean over the step's terms.
Behaviour weight: multiplies A_i (inside both arms of the clip); rho is the proximal ratio, clipped as is.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.trainer.objectives.base import (PolicyGradientObjective, PolicyGradientSettings, TermInputs, kl_penalty,
                                     ratio_metrics)
from steadyrl.trainer.objectives.registry import register


def ppo_clip_loss(ratio: Tensor, adv: Tensor, eps_clip: float) -> Tensor:
    """Per-sample -min(rho A, clip(rho, 1-eps, 1+eps) A)."""
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_clip, 1 + eps_clip))


class GRPOSettings(PolicyGradientSettings):
    name: Literal["grpo"] = "grpo"
    eps_clip: float = Field(1e-4, gt=0, lt=1, description="PPO clip range for the per-step ratio")


@register("grpo")
class GRPO(PolicyGradientObjective):
    Settings = GRPOSettings

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = inputs.new_logp - inputs.old_logp
        ratio = log_ratio.exp()
        metrics = ratio_metrics(ratio, log_ratio, self.cfg.eps_clip)
        pg = ppo_clip_loss(ratio, inputs.advantages, self.cfg.eps_clip).sum() / inputs.n_terms  # sum / n_terms
        loss = pg + kl_penalty(inputs, self.kl_weight, metrics)
        metrics["policy/pg_loss"] = pg.detach() * inputs.n_terms / len(ratio)
        return loss, metrics
