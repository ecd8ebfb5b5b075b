"""Reward back-propagation objectives: DRaFT-K and GRPO-Guard's seed form (an SVD gradient regulator).

The learner (`trainer.terms.RewardBackpropTerms`) re-runs the last K = `backprop_steps` sampling
steps from the stored x_K with the recorded noise and gradients through the policy, takes the
differentiable reward r(x_0, c) and its gradient G = dr/dx_0; the objective (`RewardBackpropObjective.loss`)
flattens G to [b, D], asks `regulate` for the gradient to use, and returns the piece's surrogate

    L_piece = -sum_{i in piece} <regulate(G)_i, x0_i(theta)> / n_terms    (n_terms = samples in the
                                                                           optimisation step, all ranks)

whose gradient, summed over the step's pieces, is -grad_theta mean_i r(x0_i) when `regulate` is the identity.
No advantages, so no behaviour weight (a lagged sample's noise is recorded under the proximal policy).

- `draft` (DRaFT-K, Clark et al. 2023): regulate(G) = G.
- `grpo_guard.seed`: with sigma_1 = ||G||_2 (the top singular value of the micro-batch's [b, D] reward
  gradient matrix) and an EMA threshold tau kept in `self.state` (checkpointed):

      tau_prev = tau if set, else sigma_1                     (initialised at the first sigma_1)
      G'       = G * tau_prev / sigma_1  if sigma_1 > tau_prev, else G
      tau      = decay * tau_prev + (1 - decay) * sigma_1      (EMA of the raw, unscaled sigma_1)

  Order: compare against the PREVIOUS tau, then update it, so ||G'||_2 = min(sigma_1, tau_prev) and the
  scale of the returned gradient never exceeds the threshold built from earlier calls; a spike raises tau
  only by (1 - decay) of itself. The statistic is per micro-batch and per rank (not all-reduced).

These objectives need no advantages: `prepare_batch` leaves the batch as it is.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.objectives.base import ObjectiveSettings, RewardBackpropObjective
from steadyrl.trainer.objectives.registry import register


class RewardBackpropSettings(ObjectiveSettings):
    """Settings every reward back-propagation objective has."""

    backprop_steps: int = Field(
        1, ge=1, description="K: back-propagate the reward through the last K sampling steps (DRaFT-K); the "
        "earlier steps are replayed from the stored trajectory without gradients")


class RewardBackprop(RewardBackpropObjective):
    """Shared behaviour: no advantages (the reward's gradient is the signal)."""

    def prepare_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        return batch, {}


class DraftSettings(RewardBackpropSettings):
    name: Literal["draft"] = "draft"


@register("draft")
class Draft(RewardBackprop):
    """DRaFT-K: the reward gradient is back-propagated unchanged."""

    Settings = DraftSettings

    def regulate(self, grad: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        return grad, {}


class GRPOGuardSeedSettings(RewardBackpropSettings):
    name: Literal["grpo_guard.seed"] = "grpo_guard.seed"
    decay: float = Field(0.9, ge=0, lt=1,
                         description="EMA decay of the threshold: tau <- decay tau + (1 - decay) sigma_1")


def top_singular_value(grad: Tensor) -> Tensor:
    """sigma_1 of a [b, D] matrix (its spectral norm), computed in float64."""
    return torch.linalg.matrix_norm(grad.detach().double(), ord=2)


@register("grpo_guard.seed")
class GRPOGuardSeed(RewardBackprop):
    """The SVD regulator on the micro-batch's reward-gradient matrix (see the module docstring)."""

    Settings = GRPOGuardSeedSettings

    def regulate(self, grad: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if grad.dim() != 2:
            raise ValueError(f"regulate expects the [b, D] reward-gradient matrix, got shape {tuple(grad.shape)}")
        sigma1 = top_singular_value(grad)
        tau_prev = self.state.get("tau")
        if tau_prev is None:
            tau_prev = sigma1.clone()
        scaled = bool(sigma1 > tau_prev)
        out = grad * (tau_prev / sigma1).to(grad.dtype) if scaled else grad
        self.state["tau"] = self.cfg.decay * tau_prev + (1 - self.cfg.decay) * sigma1
        metrics = {"guard/sigma1": sigma1, "guard/tau": self.state["tau"].clone(),
                   "guard/scaled": torch.tensor(float(scaled))}
        return out, metrics
