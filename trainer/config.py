"""Objective and learner settings (each default defined here, once)."""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from rollout.config import StrictModel


class ObjectiveConfig(StrictModel):
    """`eps_std` (advantage normalisation) and `eps_clip` (ratio clipping) are separate on purpose.

    Clip ranges and KL scales are stated for the sampler's `logp_reduce` (default: mean over pixels).
    """

    name: str = "grpo"
    eps_std: float = Field(1e-4, gt=0, description="A = (r - mean_g r) / (std_g r + eps_std)")
    eps_clip: float = Field(1e-4, gt=0, lt=1, description="PPO clip range for the per-step ratio")
    adv_clip: float = Field(5.0, gt=0, description="advantages clipped to [-adv_clip, adv_clip]")
    kl_coef: float = Field(0.0, ge=0, description="weight of the analytic Gaussian KL to the reference")
    timestep_fraction: float = Field(0.5, gt=0, le=1, description="share of trained steps drawn per sample")
    train_min_std: float = Field(
        0.0, ge=0,
        description="train only steps whose std is at least this (0: every stochastic step, as DDPO). The "
        "per-step score (x_prev - mu)/sigma^2 scales as 1/sigma, so a near-deterministic step (sigma ~ 0.006 "
        "for the digits schedule) swamps the gradient; the presets set 0.05.")


class LearnerConfig(StrictModel):
    """DeepSpeed engine settings; ZeRO stage from config, gloo on CPU, NCCL on GPU."""

    lr: float = Field(1e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    zero_stage: int = Field(0, ge=0, le=3)
    inner_epochs: int = Field(2, ge=1)
    micro_batch_size: int = Field(32, ge=1)
    backend: Literal["gloo", "nccl"] = "gloo"
    logp_alarm: float = Field(1e-3, gt=0, description="warn when |recomputed - rollout old logp| exceeds this")
