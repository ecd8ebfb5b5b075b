"""GARDO on DiffusionNFT (`gardo.nft`) = tinnerhrhe/GARDO's scripts/train_sd3_nft_gardo.py: the loss of
`diffusion_nft.code` (trainer/objectives/diffusion_nft.py, old policy and its EMA included) with GARDO's gate,
diversity-aware advantage and resettable reference (trainer/objectives/gardo.py). Once per update, on the batch:

    gate_i = the rank gate of gardo.paper (u_i = rank_proxy - mean rank_aux, percentile with adaptive beta)
    A_i    = clip((r_i - mean_g r) * w_i, +-c)      w_i gardo.paper's diversity weight; no std division
                                                   (their PerPromptStatTrackerNFT), c = `adv_clip`
    opt_i  = clamp(A_i / (2c) + 1/2, 0, 1)          the NFT optimality

Per piece (b samples of a micro-batch at one drawn grid value; n_terms = samples x grid values per sample, all T of
them by default: `timestep_fraction` 1.0, their config/base.py, where diffusion_nft's 0.99 trains 9 of 10):

    L        = sum_i c (opt_i L+_i + (1 - opt_i) L-_i) / beta / n_terms  +  kl_coef * KL_piece * b / n_terms
    KL_piece = mean_{i in P} mean (v_theta,i - v_ref,i)^2,   P = the piece's gated samples, or all of them when
               none is gated (their `idx = reward_std > 0` per micro-batch and timestep)

i.e. their per-(micro-batch, timestep) loss, policy mean + train.beta * KL_piece, averaged over the step's pieces.

Reference: a copy of the policy (their "old_ref" adapter), hard-reset to it after an update in which an optimisation
step's windowed KL (mean over its pieces of KL_piece) exceeded tau, or `ref_reset_every` updates after the last reset
(their `epoch - prev_epoch > 15`). Each reset moves tau (their code, kept as it is):

    tau <- max(tau - step, floor)   after a reset `ref_reset_every` or more updates after the last one
    tau <- min(tau + step, cap)     after a reset within `quick_reset` updates of the last one

With their numbers (tau 0.15, step 0.01, floor 0.1, cap 0.05) a quick reset sets tau to 0.05 or below: the cap is
under the floor.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.objectives.base import LearnerHooks, TermInputs
from steadyrl.trainer.objectives.diffusion_nft import (DiffusionNFTCode, DiffusionNFTSettings, optimality,
                                                       per_sample_mean)
from steadyrl.trainer.objectives.gardo import (RankGateSettings, StepKLWindow, gate_statistics, gated_diversity_batch,
                                              rank_gate, rank_gate_state)
from steadyrl.trainer.objectives.registry import register


class GARDONFTSettings(DiffusionNFTSettings, RankGateSettings):
    """DiffusionNFT's settings, GARDO's gate and its reference resets (defaults: their config/gardo.py
    `nft_sd3_geneval` and train_sd3_nft_gardo.py)."""

    name: Literal["gardo.nft"] = "gardo.nft"
    kl_coef: float = Field(0.04, ge=0, description="weight of KL_piece, the mean (v_theta - v_ref)^2 over the gated "
                           "samples (all when none is gated) to the resettable reference (their train.beta: 0.04)")
    timestep_fraction: float = Field(1.0, gt=0, le=1, description="each sample trains on floor(T x this) of the "
                                     "sampler's T grid values, a random permutation per sample: 1.0 trains all T, as "
                                     "theirs (config/gardo.py nft_sd3_geneval keeps config/base.py's 1.0; "
                                     "DiffusionNFT's own 0.99 drops one of 10)")
    ref_kl_threshold: float = Field(0.15, gt=0, description="tau at the start: reset the reference after an update "
                                    "whose windowed KL exceeded it (their thres)")
    ref_threshold_step: float = Field(0.01, ge=0, description="tau moves by this at a reset")
    ref_threshold_floor: float = Field(0.1, ge=0, description="tau <- max(tau - step, floor) after a periodic reset")
    ref_threshold_cap: float = Field(0.05, gt=0, description="tau <- min(tau + step, cap) after a quick reset (theirs "
                                     "0.05, below the floor: a quick reset lowers tau)")
    ref_reset_every: int = Field(16, ge=1, description="reset after this many updates without one")
    quick_reset: int = Field(5, ge=1, description="a reset fewer than this many updates after the last is quick")


@register("gardo.nft")
class GARDONFT(DiffusionNFTCode):
    """diffusion_nft.code's policy terms and old policy; GARDO's gate, advantage, gated KL and resets."""

    Settings = GARDONFTSettings

    def __init__(self, cfg: GARDONFTSettings):
        super().__init__(cfg)
        self.state.update({**rank_gate_state(cfg), "updates_since_reset": torch.tensor(0), "resets": torch.tensor(0),
                           "kl_threshold": torch.tensor(cfg.ref_kl_threshold, dtype=torch.float64)})
        self.window = StepKLWindow()

    @property
    def needs_reference(self) -> bool:
        return True

    def prepare_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """gate_i and A_i = clip((r_i - mean_g r) w_i, +-c) (module docstring)."""
        gate, metrics = rank_gate(batch, self.state, self.cfg)
        batch, metrics = gated_diversity_batch(batch, gate, metrics, self.cfg.adv_clip)  # no std division
        metrics["nft/optimality_mean"] = float(optimality(batch.advantages, self.cfg.adv_clip).mean())
        return batch, metrics

    def piece_statistics(self, inputs: TermInputs) -> dict[str, Tensor]:
        """The piece's gated samples and rows: KL_piece's normaliser."""
        return gate_statistics(inputs)

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """sum_i policy_i / n_terms + kl_coef KL_piece b / n_terms (module docstring)."""
        if inputs.micro is None or inputs.ref_velocity is None:
            raise ValueError("gardo.nft needs the learner's micro-batch and the reference's velocity")
        r = optimality(inputs.advantages.to(inputs.velocity.dtype), self.cfg.adv_clip)
        policy, metrics = self.policy_terms(inputs, r)  # [b] c (r L+ + (1 - r) L-) / beta
        piece = inputs.piece or self.piece_statistics(inputs)  # the whole piece's, when the learner split it
        gated, rows = int(piece["gated"]), int(piece["rows"])
        gate = inputs.micro.extras["gardo_gate"].bool().to(inputs.velocity.device)
        payers, count = (gate, gated) if gated > 0 else (torch.ones_like(gate), rows)  # P: gated, else all
        k = per_sample_mean((inputs.velocity - inputs.ref_velocity.detach()) ** 2)  # mean (v_theta - v_ref)^2
        kl_share = k[payers].sum() / count  # this part's share of KL_piece = mean_{i in P} k_i
        loss = policy.sum() / inputs.n_terms + self.kl_weight * kl_share * rows / inputs.n_terms
        self.window.add(float(kl_share.detach()), len(gate) / rows)  # a whole piece counts once
        deviate = per_sample_mean((inputs.velocity - inputs.old_velocity) ** 2).detach()
        metrics.update({"nft/policy_loss": policy.detach().mean(), "nft/kl": k.detach().mean(),
                        "gardo/kl_gated": kl_share.detach() * count / max(1, int(payers.sum())),  # this part's mean
                        "nft/old_deviate": deviate.mean()})
        return loss, metrics

    def step_done(self) -> None:
        """Close the step's windowed KL; count the optimiser step (diffusion_nft's old-policy decay)."""
        super().step_done()
        self.window.close_step()

    def after_update(self, hooks: LearnerHooks, metrics: dict[str, float]) -> dict[str, float]:
        """The old policy's EMA (diffusion_nft), then the reference reset and tau's move (module docstring)."""
        out = super().after_update(hooks, metrics)
        kl, tau = self.window.take_max(), float(self.state["kl_threshold"])
        since = int(self.state["updates_since_reset"]) + 1
        reset = kl > tau or since >= self.cfg.ref_reset_every
        if reset:
            hooks.reset_reference()
            if since >= self.cfg.ref_reset_every:
                tau = max(tau - self.cfg.ref_threshold_step, self.cfg.ref_threshold_floor)
            if since < self.cfg.quick_reset:
                tau = min(tau + self.cfg.ref_threshold_step, self.cfg.ref_threshold_cap)
            self.state["resets"] = self.state["resets"] + 1
            since = 0
        self.state["updates_since_reset"] = torch.tensor(since)
        self.state["kl_threshold"] = torch.tensor(tau, dtype=torch.float64)
        return {**out, "gardo/kl_window_max": kl, "gardo/kl_threshold": tau, "gardo/ref_reset": float(reset),
                "gardo/resets": float(self.state["resets"]), "gardo/updates_since_reset": float(since)}
