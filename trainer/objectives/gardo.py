"""GARDO, paper form (`gardo.paper`) = what tinnerhrhe/GARDO's code does (train_sd3_grpo_gardo.py,
flow_grpo/stat_tracking.py). Once per update, on the whole batch:

    u_i    = rank_main(i) - mean_k rank_aux_k(i)   batch-wide ranks, 1 = highest (reward/uncertainty.py);
             aux = every reward column but the proxy (`reward_key`) and "mean"; `uncertainty_sign`
    m      = mean{u_i : u_i >= 0};  W = the last 20 m's (before this one)
    beta   = 0.1 if W empty; else beta*1.1 if m > max W, beta*0.9 if m < min W; clip [0.02, 0.2]; W += m
    gate_i = u_i >= 0 and u_i > percentile_linear({u >= 0}, 100 - 100 beta)
    d_i    = min_{j != i in group} (1 - cos(f_i, f_j)), f L2-normalised   (reward/diversity.py)
    w_i    = d_i / mean_g d if r_i >= mean_g r else 1    (1 for the whole group when mean_g d = 0)
    A_i    = clip((r_i - mean_g r) * w_i [/ (std_g r + eps_std) if adv_std_normalise], +-adv_clip)
             (a per_reward weighting: r_i - mean_g r becomes sum_k w_k z_k,i, already scaled: no std division;
             trainer/advantages.py)

Per micro-batch x trained step (b samples, n_terms in the optimisation step):

    L   = sum_i v_i ppo_clip(rho_i, A_i) / n_terms + kl_coef * KL_piece
    v_i = sigma_i / mean_piece(sigma)   std_weighting "sigma" (their policy_loss: std_dev_t / mean(std_dev_t)),
          sigma_i = s_i / sqrt|dt_i| their std_dev_t (the noise level before sqrt|dt|; s the step std);
        = s_i / mean_piece(s)           "step";   = 1   "none" (and on samplers without Gaussian steps)
          (1 exactly when the piece shares one step, as in their trainer; ours draws each sample's step)
    KL_piece = (sum_{i gated} k_i / #gated) * b / n_terms          kl_average "gated" (their mean; default)
             = sum_{i gated} k_i / n_terms                         kl_average "all_terms"
    Defaults = their code; kl_average "all_terms" + std_weighting "none" = the earlier form
    (`gardo.paper[kl_all,no_std_weight]`). gardo.seed keeps that earlier form as its default.
    k_i = ||mu_theta - mu_ref||^2 / (2 s^2) * |dt|  ("code": their sigma_t without sqrt|dt|), or without
          the |dt| factor ("exact"; s the step std), in the sampler's pixel reduction. No gated sample: no KL.
          (A sampler without Gaussian steps has no |dt|: k_i is its KL as it is.)
    n_terms = samples in the optimisation step (all ranks) x trained steps drawn per sample.

Behaviour weight: multiplies A_i inside the PPO clip; the gated KL is not weighted.

After each update (hard reset of the reference): the windowed KL of an optimisation step is the mean
over its pieces of mean_{gated} k_i (0 for a piece without gated samples), as their `info["kl_loss"]`
(a piece split to fit memory counts once: its parts add their shares of its #gated and b);
reset when the largest window of the update exceeds `ref_kl_threshold` (in k's units), or when
`ref_reset_every` updates have passed since the last reset (their `epoch - prev_epoch > reset_freq=15`
resets every 16 updates).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.reward.diversity import cosine_nearest_neighbour_distance
from steadyrl.reward.uncertainty import rank_difference_uncertainty
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.advantages import centred_rewards
from steadyrl.trainer.objectives.base import (LearnerHooks, ObjectiveSettings, PolicyGradientObjective,
                                              PolicyGradientSettings, TermInputs, ratio_metrics)
from steadyrl.trainer.objectives.grpo import ppo_clip_loss
from steadyrl.trainer.objectives.registry import register


class GARDOCommonSettings(PolicyGradientSettings):
    eps_clip: float = Field(1e-4, gt=0, lt=1, description="PPO clip range (their train.clip_range)")
    kl_coef: float = Field(0.04, ge=0, description="KL weight on gated samples (their configs: 0.01-0.07)")
    kl: Literal["code", "exact"] = Field("code", description="code: KL * |dt| (sigma_t without sqrt|dt|)")
    kl_average: Literal["all_terms", "gated"] = Field(
        "all_terms", description="all_terms: sum over gated / n_terms; gated: their mean over the gated samples")
    adv_std_normalise: bool = Field(False, description="divide by the group std + eps_std (their code: no)")
    std_weighting: Literal["sigma", "step", "none"] = Field(
        "none", description="PPO term weight std_b / mean(std) over the piece (sigma: std / sqrt|dt|; none: 1)")


class RankGateSettings(ObjectiveSettings):
    """The rank gate's settings (`rank_gate`), shared by gardo.paper and gardo.nft (their RiskCompensator)."""

    uncertainty_sign: Literal["code", "over_rating"] = "code"
    beta_init: float = Field(0.1, gt=0, le=1)
    beta_min: float = Field(0.02, gt=0, le=1)
    beta_max: float = Field(0.2, gt=0, le=1)
    beta_rate: float = Field(0.1, ge=0, lt=1, description="beta *= 1 +- rate")
    beta_window: int = Field(20, ge=1, description="past m's compared against")


class GARDOPaperSettings(GARDOCommonSettings, RankGateSettings):
    name: Literal["gardo.paper"] = "gardo.paper"
    kl_average: Literal["all_terms", "gated"] = Field(
        "gated", description="gated: their mean over the gated samples; all_terms: sum over gated / n_terms")
    std_weighting: Literal["sigma", "step", "none"] = Field(
        "sigma", description="each sample's PPO term times std_b / mean(std) over the piece: sigma = their "
                             "std_dev_t (step std / sqrt|dt|), step = the step std, none = weight 1")
    ref_kl_threshold: float = Field(3e-4, gt=0, description="hard reset when a windowed KL exceeds this")
    ref_reset_every: int = Field(16, ge=1, description="hard reset after this many updates without one")


def diversity_advantages(batch: RolloutBatch, adv_clip: float, std_normalise: bool = False,
                         eps_std: float = 1e-4) -> tuple[Tensor, Tensor, Tensor]:
    """(A, w, d) [B] of the diversity-aware advantage (module docstring)."""
    if batch.features is None:
        raise ValueError("GARDO's diversity-aware advantage needs batch.features (the ensemble's feature network)")
    signal, normalised = centred_rewards(batch)
    r = signal.double()
    d = cosine_nearest_neighbour_distance(batch.features, batch.group)
    adv, w = torch.zeros_like(r), torch.ones_like(r)
    for g in batch.group.unique():
        idx = batch.group == g
        rg, dg = r[idx], d[idx]
        centred = rg if normalised else rg - rg.mean()
        if dg.mean() > 0:
            w[idx] = torch.where(centred >= 0, dg / dg.mean(), torch.ones_like(dg))
        scale = (rg.std(unbiased=False) + eps_std) if std_normalise and not normalised else 1
        adv[idx] = centred * w[idx] / scale
    return adv.clamp(-adv_clip, adv_clip).to(batch.train_reward().dtype), w, d


def aux_scores(batch: RolloutBatch) -> Tensor:
    """[B,K] auxiliary reward columns: all but the proxy (`reward_key`) and the ensemble mean."""
    cols = [k for k, n in enumerate(batch.reward_names) if n not in (batch.reward_key, "mean")]
    if not cols:
        raise ValueError(f"GARDO needs auxiliary rewards besides {batch.reward_key!r}: {batch.reward_names}")
    return batch.rewards[:, cols]


def adapt_beta(beta: float, window: Tensor, m: float, cfg: RankGateSettings) -> tuple[float, Tensor]:
    """Their RiskCompensator.update: compare m with the window *before* appending it."""
    if len(window) == 0:
        beta = cfg.beta_init
    elif m > float(window.max()):
        beta *= 1 + cfg.beta_rate
    elif m < float(window.min()):
        beta *= 1 - cfg.beta_rate
    beta = min(max(beta, cfg.beta_min), cfg.beta_max)
    window = torch.cat([window, torch.tensor([m], dtype=torch.float64)])[-cfg.beta_window:]
    return beta, window


def percentile_gate(u: Tensor, beta: float) -> tuple[Tensor, float]:
    """u >= 0 and u > the linear (100 - 100 beta)-th percentile of the u >= 0 values."""
    pos = u[u >= 0].double()
    thr = float(torch.quantile(pos, 1 - beta, interpolation="linear")) if len(pos) else float("inf")
    return (u >= 0) & (u > thr), thr


def rank_gate_state(cfg: RankGateSettings) -> dict[str, Tensor]:
    """The rank gate's state at the start: beta and the window of past m's."""
    return {"beta": torch.tensor(cfg.beta_init, dtype=torch.float64), "m_window": torch.zeros(0, dtype=torch.float64)}


def rank_gate(batch: RolloutBatch, state: dict[str, Tensor], cfg: RankGateSettings) -> tuple[Tensor, dict[str, float]]:
    """[B] bool, the samples that pay the KL (module docstring: u, m, beta, gate_i); moves `state`'s beta and window."""
    u = rank_difference_uncertainty(batch.train_reward(), aux_scores(batch), cfg.uncertainty_sign)
    m = float(u[u >= 0].mean()) if bool((u >= 0).any()) else 0.0  # sum u = 0: never empty
    beta, state["m_window"] = adapt_beta(float(state["beta"]), state["m_window"], m, cfg)
    state["beta"] = torch.tensor(beta, dtype=torch.float64)
    gate, thr = percentile_gate(u, beta)
    return gate, {"gardo/beta": beta, "gardo/u_mean": m, "gardo/u_threshold": thr}


def gated_diversity_batch(batch: RolloutBatch, gate: Tensor, metrics: dict[str, float], adv_clip: float,
                          std_normalise: bool = False, eps_std: float = 1e-4) -> tuple[RolloutBatch, dict[str, float]]:
    """The batch with the diversity-aware advantage and the gate (extras["gardo_gate"]), and the gate's and the
    diversity weight's metrics added to `metrics`."""
    adv, w, d = diversity_advantages(batch, adv_clip, std_normalise, eps_std)
    metrics.update({"gardo/gate_frac": float(gate.double().mean()), "gardo/div_weight_mean": float(w.mean()),
                    "gardo/div_distance_mean": float(d.mean())})
    return batch.replace(advantages=adv).with_extras(gardo_gate=gate), metrics


def gate_statistics(inputs: TermInputs) -> dict[str, Tensor]:
    """A piece's gated samples and rows (sums over its rows: a split piece's parts add up to them)."""
    if inputs.micro is None:
        raise ValueError("GARDO needs the learner's micro-batch")
    gate = inputs.micro.extras["gardo_gate"].bool()
    return {"gated": gate.sum(), "rows": torch.tensor(len(gate))}


class StepKLWindow:
    """GARDO's windowed KL (their `info["kl_loss"]`, logged per optimiser step): the mean over an optimisation step's
    pieces of each piece's KL; `take_max` gives the update's largest, the max over the learner ranks (each rank's
    window is over its own pieces). A piece split to fit memory counts once: each part adds its share of the piece's
    KL and its fraction of the piece's rows."""

    def __init__(self) -> None:
        self.kl, self.pieces, self.largest = 0.0, 0.0, 0.0

    def add(self, kl_share: float, piece_fraction: float) -> None:
        self.kl += kl_share
        self.pieces += piece_fraction

    def close_step(self) -> None:
        """The optimisation step's last piece is in: its mean joins the update's max."""
        if self.pieces > 0:
            self.largest = max(self.largest, self.kl / self.pieces)
        self.kl, self.pieces = 0.0, 0.0

    def take_max(self) -> float:
        """The update's largest step window (max over learner ranks), and clear it."""
        self.close_step()
        value = torch.tensor(self.largest, dtype=torch.float64)
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            torch.distributed.all_reduce(value, op=torch.distributed.ReduceOp.MAX)
        self.largest = 0.0
        return float(value)


class GARDOBase(PolicyGradientObjective):
    """Shared loss (PPO clip on all samples + KL on the gated ones) and per-step windowed KL."""

    def __init__(self, cfg: GARDOCommonSettings):
        super().__init__(cfg)
        self.window = StepKLWindow()

    @property
    def needs_reference(self) -> bool:
        return True

    @abstractmethod
    def gate(self, batch: RolloutBatch) -> tuple[Tensor, dict[str, float]]:
        """[B] bool: the samples that pay the KL this update, and metrics."""

    def prepare_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        gate, metrics = self.gate(batch)
        return gated_diversity_batch(batch, gate, metrics, self.cfg.adv_clip, self.cfg.adv_std_normalise,
                                     self.cfg.eps_std)

    def piece_statistics(self, inputs: TermInputs) -> dict[str, Tensor]:
        """The piece's gated samples and rows: the `gated` KL average's and the window's normalisers."""
        stats = gate_statistics(inputs)
        sigma = self.weight_std(inputs)
        if sigma is not None:
            stats["std_sum"] = sigma.sum()
        return stats

    def weight_std(self, inputs: TermInputs) -> Tensor | None:
        """[b] the std of `std_weighting` (None: weight 1): sigma = s / sqrt|dt| (their std_dev_t), or s."""
        if self.cfg.std_weighting == "none" or inputs.std is None:
            return None
        std = inputs.std.detach().double()
        if self.cfg.std_weighting == "sigma" and inputs.dt is not None:
            std = std / inputs.dt.detach().double().sqrt()  # sigma_t = s / sqrt|dt|
        return std

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if inputs.kl_ref is None or inputs.micro is None:
            raise ValueError("GARDO needs the learner's kl_ref and micro-batch")
        piece = inputs.piece or self.piece_statistics(inputs)  # the whole piece's, when the learner split it
        gated, rows = int(piece["gated"]), int(piece["rows"])
        log_ratio = inputs.new_logp - inputs.old_logp
        ratio = log_ratio.exp()
        metrics = ratio_metrics(ratio, log_ratio, self.cfg.eps_clip)
        per_sample = ppo_clip_loss(ratio, inputs.advantages, self.cfg.eps_clip)
        sigma = self.weight_std(inputs)
        if sigma is not None:  # v_i = sigma_i / mean_piece(sigma), the mean over the whole (unsplit) piece
            weight = sigma / (piece["std_sum"].double() / rows)
            per_sample = per_sample * weight.to(per_sample.dtype)
            metrics["gardo/std_weight_max"] = weight.max()
        pg = per_sample.sum() / inputs.n_terms  # sum_i v_i ppo_i / n_terms
        metrics["policy/pg_loss"] = pg.detach() * inputs.n_terms / len(ratio)
        gate = inputs.micro.extras["gardo_gate"].bool()
        k = inputs.kl_ref * inputs.dt if self.cfg.kl == "code" and inputs.dt is not None else inputs.kl_ref
        loss, piece_kl = pg, 0.0
        if bool(gate.any()):
            kl = k[gate].sum() / inputs.n_terms
            if self.cfg.kl_average == "gated":
                kl = kl * rows / gated  # b / #gated of the whole piece
            loss = pg + self.kl_weight * kl
            piece_kl = float(k[gate].detach().mean()) * (int(gate.sum()) / gated)  # a part's share of the mean
            metrics["gardo/kl_gated"] = k[gate].detach().mean()
        self.window.add(piece_kl, len(gate) / rows)  # a whole piece counts once, its parts their shares
        return loss, metrics

    def step_done(self) -> None:
        self.window.close_step()


@register("gardo.paper")
class GARDOPaper(GARDOBase):
    Settings = GARDOPaperSettings

    def __init__(self, cfg: GARDOPaperSettings):
        super().__init__(cfg)
        self.state = {**rank_gate_state(cfg), "updates_since_reset": torch.tensor(0), "resets": torch.tensor(0)}

    def gate(self, batch: RolloutBatch) -> tuple[Tensor, dict[str, float]]:
        return rank_gate(batch, self.state, self.cfg)

    def after_update(self, hooks: LearnerHooks, metrics: dict[str, float]) -> dict[str, float]:
        kl = self.window.take_max()
        since = int(self.state["updates_since_reset"]) + 1
        reset = kl > self.cfg.ref_kl_threshold or since >= self.cfg.ref_reset_every
        if reset:
            hooks.reset_reference()
            self.state["resets"] = self.state["resets"] + 1
            since = 0
        self.state["updates_since_reset"] = torch.tensor(since)
        return {"gardo/kl_window_max": kl, "gardo/ref_reset": float(reset),
                "gardo/resets": float(self.state["resets"]), "gardo/updates_since_reset": float(since)}
