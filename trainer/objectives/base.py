"""What every objective shares: its settings base, the inputs it sees, and its lifecycle.

One update (an RL step) of the learner, as the objective sees it:

    batch, m = obj.prepare_batch(batch)            # once, whole batch: advantages, gates, weights
    for each optimisation step (optim_batch_size samples, several micro-batches):
        stats = obj.prepare(pieces)                # no grad: whole-step normalisers, per-step stats
        for each micro-batch x trained step:
            loss, m = obj.loss(inputs, stats)      # this piece's share of the step's loss
            backward(loss)
        optimiser step
    m = obj.after_update(hooks)                    # reference reset / EMA, adaptive constants

Losses are sums with explicit normalisers: `loss` returns this piece's contribution to the
optimisation step's objective (e.g. sum over the piece / `inputs.n_terms`), and the learner adds
the pieces without rescaling them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import StrictModel
from steadyrl.trainer.advantages import group_advantages


class ObjectiveSettings(StrictModel):
    """Settings every objective has. Each objective extends this with its own (unknown keys are errors)."""

    name: str
    train_min_std: float = Field(
        0.0, ge=0,
        description="train only steps whose std is at least this (0: every stochastic step, as DDPO). The "
        "per-step score (x_prev - mu)/sigma^2 scales as 1/sigma, so a near-deterministic step (sigma ~ 0.006 "
        "for the digits DDIM schedule) swamps the gradient; the GRPO presets set 0.05.")


class PolicyGradientSettings(ObjectiveSettings):
    """Settings of the per-step likelihood-ratio objectives. `eps_std` (advantage normalisation) and
    `eps_clip` (ratio clipping, where an objective clips) are separate on purpose."""

    eps_std: float = Field(1e-4, gt=0, description="A = (r - mean_g r) / (std_g r + eps_std)")
    adv_clip: float = Field(5.0, gt=0, description="advantages clipped to [-adv_clip, adv_clip]")
    kl_coef: float = Field(0.0, ge=0, description="weight of the analytic Gaussian KL to the reference")
    timestep_fraction: float = Field(0.5, gt=0, le=1, description="share of trained steps drawn per sample")


@dataclass
class StepInputs:
    """One micro-batch at one sampled trained step per sample (b samples)."""

    new_logp: Tensor  # [b] with grad
    old_logp: Tensor  # [b] recomputed without grad at the start of the update
    advantages: Tensor  # [b]
    step: Tensor  # [b] inference-step index of each sample's term
    std: Tensor  # [b] the step's Gaussian std
    dt: Tensor  # [b] |Delta t| of the step
    n_terms: int  # (sample, step) terms in the whole optimisation step: the mean's denominator
    rows: Tensor | None = None  # [b] each sample's index within the optimisation step (matches PreparePiece.rows)
    new_mean: Tensor | None = None  # [b,...] with grad
    old_mean: Tensor | None = None  # [b,...] recomputed at the start of the update (when requested)
    kl_ref: Tensor | None = None  # [b] KL(pi_theta || pi_ref) at the step, with grad (when requested)
    micro: RolloutBatch | None = None  # the micro-batch (uncertainty, features, extras)
    reduce: str = "mean"  # the sampler's pixel reduction of log-probs and KLs
    tokens: Any = None  # masked diffusion: this MC sample's per-token terms, with grad (rollout.likelihood)


@dataclass
class PreparePiece:
    """No-grad view of one micro-batch's terms in an optimisation step, for `Objective.prepare`."""

    new_logp: Tensor  # [b] at the current parameters
    old_logp: Tensor  # [b]
    advantages: Tensor  # [b]
    step: Tensor  # [b]
    std: Tensor  # [b]
    dt: Tensor  # [b]
    rows: Tensor  # [b] each sample's index within the optimisation step
    new_mean: Tensor | None = None
    old_mean: Tensor | None = None
    group: Tensor | None = None  # [b] prompt group of each sample
    tokens: list[Any] | None = None  # masked diffusion: per-token terms of each MC sample (no grad)


class LearnerHooks(Protocol):
    """What `after_update` may ask of the learner."""

    def reset_reference(self) -> None:
        """Hard-copy the policy into the reference."""

    def ema_reference(self, decay: float) -> None:
        """ref <- decay * ref + (1 - decay) * policy."""


class Objective(ABC):
    """Base objective: group-relative advantages, no prepare statistics, no reference updates.

    Class attributes say what the learner must compute for it:
      mode:            "policy_gradient" (per-step log-prob ratios) or "reward_backprop" (DRaFT-K)
      needs_prepare:   run the no-grad `prepare` pass (new log-probs of the step's terms) per optimiser step
      needs_old_mean:  keep the old policy's step means from the recompute pass
      needs_reference: compute KL(pi_theta || pi_ref) at each term
      ratio_scope:     with a sequence-level sampler (masked diffusion, steps = MC mask samples):
                       "sequence" -- the ratio is exp(mean_j ell_j - mean_j ell_j^old), one per sequence
                       (the learner's two-pass pieces, `DeepSpeedLearner._sequence_step`); "term" -- each
                       MC sample's own ratio (BGPO's bound). Image samplers are always per step.
    State lives in `self.state` as tensors and is checkpointed with torch.save.
    """

    name: ClassVar[str]
    Settings: ClassVar[type[ObjectiveSettings]]
    mode: ClassVar[Literal["policy_gradient", "reward_backprop"]] = "policy_gradient"
    needs_prepare: ClassVar[bool] = False
    needs_old_mean: ClassVar[bool] = False
    ratio_scope: ClassVar[Literal["sequence", "term"]] = "sequence"

    def __init__(self, cfg: ObjectiveSettings):
        self.cfg = cfg
        self.state: dict[str, Tensor] = {}

    @property
    def needs_reference(self) -> bool:
        return float(getattr(self.cfg, "kl_coef", 0.0)) > 0

    def advantages(self, batch: RolloutBatch) -> Tensor:
        """A_i = clip((r_i - mean_g r) / (std_g r + eps_std), -adv_clip, adv_clip) within each prompt group."""
        cfg = self.cfg
        return group_advantages(batch.train_reward(), batch.group, cfg.eps_std).clamp(-cfg.adv_clip, cfg.adv_clip)

    def prepare_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """Once per update on the whole batch (before sharding): set advantages and any per-sample extras."""
        return batch.replace(advantages=self.advantages(batch)), {}

    @torch.no_grad()
    def prepare(self, pieces: list[PreparePiece]) -> dict[str, Tensor]:
        """No-grad statistics over the whole optimisation step (all-reduced across ranks later)."""
        return {}

    def after_update(self, hooks: LearnerHooks, metrics: dict[str, float]) -> dict[str, float]:
        """After each update: reference resets/EMA, adaptive constants. Returns extra metrics."""
        return {}

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.state = {k: v.clone() for k, v in state.items()}


class PolicyGradientObjective(Objective):
    """An objective over per-step likelihood ratios: `loss` is called per micro-batch and trained step."""

    @abstractmethod
    def loss(self, inputs: StepInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """This piece's contribution to the optimisation step's loss, and its metrics."""


class RewardBackpropObjective(Objective):
    """Back-propagates a differentiable reward through the last `backprop_steps` sampling steps (DRaFT-K).

    The learner computes x_0 with gradients, the reward r(x_0) and G = dr/dx_0 [b, D]; `regulate`
    may rescale G; the surrogate -sum(G * x_0) / n then has gradient -grad_theta mean r.
    """

    mode = "reward_backprop"

    @abstractmethod
    def regulate(self, grad: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The reward gradient to back-propagate ([b, D] -> [b, D]) and metrics."""


def kl_penalty(inputs: StepInputs, kl_coef: float, metrics: dict[str, Tensor]) -> Tensor:
    """kl_coef * sum over the piece of KL(pi_theta || pi_ref) / n_terms (0 when off)."""
    if inputs.kl_ref is None or kl_coef <= 0:
        return torch.zeros((), dtype=inputs.new_logp.dtype)
    metrics["policy/kl_ref"] = inputs.kl_ref.detach().mean()
    return kl_coef * inputs.kl_ref.sum() / inputs.n_terms


def ratio_metrics(ratio: Tensor, log_ratio: Tensor, eps_clip: float | None) -> dict[str, Tensor]:
    """Ratio mean/std/max, clip fraction (|rho - 1| > eps_clip) and the k3 estimate of KL(old || new)."""
    r = ratio.detach()
    out = {
        "policy/ratio_mean": r.mean(),
        "policy/ratio_std": r.std(unbiased=False),
        "policy/ratio_max": r.max(),
        "policy/approx_kl_old": ((r - 1) - log_ratio.detach()).mean(),
    }
    if eps_clip is not None:
        out["policy/clip_frac"] = ((r - 1).abs() > eps_clip).float().mean()
    return out
