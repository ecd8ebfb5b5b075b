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

  Knobs (each off by default, so the defaults are the regulator above bit for bit; docs/objectives.md):
  * `threshold_scale` c(u), a linear schedule over updates (trainer/linear_schedule.py): every comparison is
    against c(u) * tau_prev (the reward-gradient's and each block's), G' = G * c tau_prev / sigma_1 when sigma_1 >
    c tau_prev; the EMAs still track the raw sigma. c < 1 tightens the guard as a run matures.
  * `monitor_every` k: the SVDs run only in optimisation steps s with s mod k == 0 (s counted by the objective,
    checkpointed); in the other steps each regulated quantity is multiplied by the scale of its last monitored
    call and no threshold moves.
  * `block_thresholds` {down, mid, up -> c_b}: a spectral guard on the parameter gradients of a UNet's block
    groups (parameters whose dotted name has the component down_blocks / mid_block / up_blocks: diffusers'
    UNet2DModel, UNet2DConditionModel and the digits UNet; LoRA adapters inside them included). Once per
    optimisation step, on the accumulated gradients (`regulate_gradients`):

        sigma_b  = max over the block's gradient matrices W of ||W||_2     (>= 2-D, flattened to [out, -1])
        tau_b    = sigma_b at the first monitored step
        g <- g * c(u) c_b tau_b / sigma_b for every gradient of the block, if sigma_b > c(u) c_b tau_b
        tau_b   <- decay tau_b + (1 - decay) sigma_b

    Our reading of the seed's "per-block (down/mid/up) thresholds" (it gives no code): a spike in one block
    group's gradient is held back to its own running level without touching the others.

Optional batch-diversity term (both objectives; `diversity_coef` = lambda, default 0: off): each piece adds

    L_div = -lambda * D_piece * b / n_terms      D_piece = mean RMS distance of the piece's x0 pairs within a
                                                 prompt group (trainer/diversity_loss.py), b = samples in the piece

so the step's loss gains -lambda times the sample-weighted mean of the pieces' D (= -lambda D when one piece
holds the step). Pairs are formed inside a piece (its graph), so groups split across micro-batches count only
their pairs that share one. Metrics: `diversity/x0_pairwise` (D) and `diversity/x0_pairs` (|P|).

These objectives need no advantages: `prepare_batch` leaves the batch as it is.
"""
from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.linear_schedule import LinearSchedule, linear_value
from steadyrl.trainer.diversity_loss import group_pairwise_distance
from steadyrl.trainer.objectives.base import ObjectiveSettings, RewardBackpropObjective, TermInputs
from steadyrl.trainer.objectives.registry import register


class RewardBackpropSettings(ObjectiveSettings):
    """Settings every reward back-propagation objective has."""

    language_models: ClassVar[bool] = False  # re-runs Gaussian sampling steps: images only

    backprop_steps: int = Field(
        1, ge=1, description="K: back-propagate the reward through the last K sampling steps (DRaFT-K); the "
        "earlier steps are replayed from the stored trajectory without gradients")
    diversity_coef: float = Field(
        0.0, ge=0, description="lambda of the batch-diversity term -lambda * D (D: mean RMS distance of x0 pairs "
        "within a prompt group, module docstring); a reward gradient alone pulls a prompt's samples towards its "
        "reward's mode. 0: off")


class RewardBackprop(RewardBackpropObjective):
    """Shared behaviour: no advantages (the reward's gradient is the signal)."""

    def prepare_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        return batch, {}

    def split_refusal(self) -> str | None:
        if self.cfg.diversity_coef > 0:
            return (f"objective.diversity_coef={self.cfg.diversity_coef}: the diversity term D_piece pairs the "
                    "samples inside a piece, which a split would change")
        return None

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """The reward surrogate, minus lambda * D_piece * b / n_terms when `diversity_coef` > 0 (module docstring)."""
        surrogate, metrics = super().loss(inputs, stats)
        lam = self.cfg.diversity_coef
        if lam > 0:
            if inputs.micro is None:
                raise ValueError("objective.diversity_coef > 0 needs the piece's prompt groups (TermInputs.micro)")
            d, pairs = group_pairwise_distance(inputs.sample, inputs.micro.group)
            surrogate = surrogate - lam * d * inputs.sample.shape[0] / inputs.n_terms
            metrics["diversity/x0_pairwise"] = d.detach()
            metrics["diversity/x0_pairs"] = torch.tensor(float(pairs))
        return surrogate, metrics


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
    monitor_every: int = Field(
        1, ge=1, description="k: compute the singular values only every k optimisation steps and reuse the last "
        "scale in between (1: every step); the SVDs of a large UNet's gradients are the guard's cost")
    threshold_scale: LinearSchedule = Field(
        default_factory=LinearSchedule,
        description="c(u), linear over the run's updates: the guard compares sigma with c(u) x its EMA threshold "
        "(start/end in (0, 10]; 1: the threshold itself); below 1 the guard tightens as the run matures")
    block_thresholds: dict[Literal["down", "mid", "up"], float] = Field(
        default_factory=dict,
        description="per UNet block group (down_blocks / mid_block / up_blocks) its factor c_b > 0: the group's "
        "parameter gradients are scaled down when their largest spectral norm exceeds c(u) c_b x its own EMA "
        "threshold (empty: off); needs learner.zero_stage=0")

    @model_validator(mode="after")
    def _bounds(self) -> "GRPOGuardSeedSettings":
        bad = self.threshold_scale.bounds_error("objective.threshold_scale", 0.0, 10.0, low_open=True)
        if bad:
            raise ValueError(f"{bad}: a factor on the EMA threshold (0 would zero every gradient)")
        for block, c in self.block_thresholds.items():
            if not 0 < c <= 10:
                raise ValueError(f"objective.block_thresholds.{block}={c} must be in (0, 10]: a factor on the "
                                 "block's EMA threshold")
        return self

    def zero_partition_refusal(self) -> str | None:
        if self.block_thresholds:
            return ("objective.block_thresholds needs learner.zero_stage=0 (ZeRO 1-3 partition the gradients: a "
                    "block's gradient matrices are not on one rank's parameters)")
        return None


BLOCK_MODULES = {"down": "down_blocks", "mid": "mid_block", "up": "up_blocks"}  # diffusers' UNet module names


def top_singular_value(grad: Tensor) -> Tensor:
    """sigma_1 of a [b, D] matrix (its spectral norm), computed in float64."""
    return torch.linalg.matrix_norm(grad.detach().double(), ord=2)


def block_gradients(network: nn.Module, block: str) -> list[Tensor]:
    """The gradients of the parameters under a block group (`BLOCK_MODULES`: a component of their dotted name)."""
    module = BLOCK_MODULES[block]
    return [p.grad for name, p in network.named_parameters() if p.grad is not None and module in name.split(".")]


def largest_spectral_norm(grads: list[Tensor]) -> Tensor:
    """max over the >= 2-D gradients W of ||W.reshape(out, -1)||_2 (float64 scalar; 0 without any)."""
    norms = [torch.linalg.matrix_norm(g.detach().reshape(g.shape[0], -1).double(), ord=2) for g in grads
             if g.dim() >= 2]
    return torch.stack(norms).max() if norms else torch.zeros((), dtype=torch.float64)


@register("grpo_guard.seed")
class GRPOGuardSeed(RewardBackprop):
    """The SVD regulator on the micro-batch's reward-gradient matrix (see the module docstring)."""

    Settings = GRPOGuardSeedSettings

    def __init__(self, cfg: GRPOGuardSeedSettings):
        super().__init__(cfg)
        self._block_metrics: dict[str, float] = {}

    def split_refusal(self) -> str | None:
        return ("objective grpo_guard.seed regulates each piece's reward-gradient matrix by its top singular value "
                "(and moves its threshold per piece): a split piece's parts have other singular values")

    def _threshold_scale(self) -> float:
        """c(u) of this update (`threshold_scale`)."""
        return linear_value(self.cfg.threshold_scale, self.schedule.index, "objective.threshold_scale")

    def _monitored(self, key: str) -> bool:
        """Does this optimisation step compute the singular values of `key` (else: reuse its last scale)?"""
        steps = int(self.state.get("optim_steps", 0))
        return steps % self.cfg.monitor_every == 0 or f"scale{key}" not in self.state

    def _guard(self, key: str, sigma: Tensor, factor: float) -> tuple[Tensor, bool]:
        """A monitored call: (scale, scaled), scale = c tau_prev / sigma if sigma > c tau_prev (c = `factor`), else
        1; then tau <- decay tau_prev + (1 - decay) sigma. State: tau{key}, scale{key} (float64 scalars)."""
        tau_prev = self.state.get(f"tau{key}")
        if tau_prev is None:
            tau_prev = sigma.clone()
        threshold = factor * tau_prev  # factor 1.0: tau_prev exactly
        scaled = bool(sigma > threshold)
        scale = threshold / sigma if scaled else torch.ones((), dtype=sigma.dtype)
        self.state[f"tau{key}"] = self.cfg.decay * tau_prev + (1 - self.cfg.decay) * sigma
        self.state[f"scale{key}"] = scale
        return scale, scaled

    def regulate(self, grad: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        if grad.dim() != 2:
            raise ValueError(f"regulate expects the [b, D] reward-gradient matrix, got shape {tuple(grad.shape)}")
        if not self._monitored(""):  # between monitored steps: the last scale, no SVD, tau unchanged
            scale = self.state["scale"]
            out = grad * scale.to(grad.dtype) if bool(scale != 1) else grad
            return out, {"guard/scaled": torch.tensor(float(scale != 1)), "guard/monitored": torch.tensor(0.0)}
        sigma1 = top_singular_value(grad)
        scale, scaled = self._guard("", sigma1, self._threshold_scale())
        out = grad * scale.to(grad.dtype) if scaled else grad
        metrics = {"guard/sigma1": sigma1, "guard/tau": self.state["tau"].clone(),
                   "guard/scaled": torch.tensor(float(scaled)), "guard/monitored": torch.tensor(1.0)}
        return out, metrics

    @torch.no_grad()
    def regulate_gradients(self, network: nn.Module) -> None:
        """The per-block spectral guard on the step's parameter gradients (module docstring), then count the
        optimisation step (the clock of `monitor_every`)."""
        c = self._threshold_scale()
        for block, factor in self.cfg.block_thresholds.items():
            grads = block_gradients(network, block)
            if not grads:
                tops = sorted({name.split(".")[0] for name, _ in network.named_parameters()})
                raise ValueError(f"objective.block_thresholds.{block}: {type(network).__name__} has no gradients "
                                 f"under a module named {BLOCK_MODULES[block]!r} (top-level modules: {tops}); the "
                                 "per-block guard needs a UNet with down_blocks / mid_block / up_blocks")
            key = f"_{block}"
            if self._monitored(key):
                sigma = largest_spectral_norm(grads)
                scale, _ = self._guard(key, sigma, c * factor)
                self._block_metrics[f"guard/{block}_sigma"] = float(sigma)
                self._block_metrics[f"guard/{block}_tau"] = float(self.state[f"tau{key}"])
            else:
                scale = self.state[f"scale{key}"]
            if bool(scale != 1):
                for g in grads:
                    g.mul_(scale.to(g.dtype))
            self._block_metrics[f"guard/{block}_scale"] = float(scale)
        self.state["optim_steps"] = self.state.get("optim_steps", torch.zeros((), dtype=torch.long)) + 1

    def after_update(self, hooks, metrics: dict[str, float]) -> dict[str, float]:
        """The threshold factor of this update and each block's last sigma, tau and scale."""
        return {"guard/threshold_scale": self._threshold_scale(), **self._block_metrics}
