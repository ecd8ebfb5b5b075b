"""The no-grad pre-pass at the start of an update, one concern each:

  old_policy               the old (proximal) policy's log-probs, and where asked its step means, at every trained
                           step, with the update's own micro-batching (float32 numerics depend on batch shape)
  reference_sequence_logp  sequence-level samplers: the reference's sequence estimate (KL monitor and penalty)
  recorded_noise           reward back-propagation: the noise of the last K stored steps
  RecomputeAlarm           the gap between recomputed and rollout log-probs of current samples
                           (`policy/rollout_logp_absdiff_max`; a warning above `learner.logp_alarm`), and per token
                           where the sampler kept its tokens' log-probs (`policy/rollout_token_logp_absdiff_max`)
  BehaviourWeights         lagged (asynchronous) samples, and samples of an inference engine (vLLM, whose numerics
                           are not the learner's): min(pi_prox / pi_b, cap) (trainer/off_policy.py)
  kl_monitor               KL(pi_theta || pi_ref) (`policy/kl_ref_monitor`)

`recompute_old` runs them per micro-batch, in that order; forward-process objectives (DiffusionNFT), which read
no log-probs, get only the KL monitor.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from steadyrl.rollout.batch import BEHAVIOUR_ENGINE, BEHAVIOUR_TOKEN_LOGP, RolloutBatch
from steadyrl.rollout.sampler import LogProb, Sampler
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.context import UpdateContext
from steadyrl.trainer.objectives import RewardBackpropObjective
from steadyrl.trainer.off_policy import behaviour_weight, staleness

log = logging.getLogger(__name__)


@dataclass
class OldPolicy:
    """The old policy on one micro-batch, recomputed without grad at the start of an update."""

    logp: Tensor  # [b,T] (0 at untrained steps)
    mean: Tensor | None = None  # [b,T,...] where the objective needs old means
    noise: list[Tensor] | None = None  # recorded noise of the last K steps (reward back-propagation)
    ref_logp: Tensor | None = None  # [b] sequence-level samplers: the reference's mean over MC samples
    behaviour_weight: Tensor | None = None  # [b,T] (sequence-level: [b]) min(pi_prox/pi_b, c); None: all current
    token_logp: Tensor | None = None  # [b,T,L] per-token log-probs of each MC sample (token-level objectives)

    def weighted(self, advantages: Tensor, rows: Tensor | None = None, step: Tensor | None = None) -> Tensor:
        """Advantages times the behaviour weight of each term (trainer/off_policy.py); unchanged when current."""
        if self.behaviour_weight is None or advantages is None:
            return advantages
        w = self.behaviour_weight
        if rows is not None:  # a term's rows (at its step; a sequence-level weight [b] has one per row)
            w = w[rows] if w.dim() == 1 else w[rows, step]
        return advantages * w.to(advantages)

    @property
    def sequence_logp(self) -> Tensor:
        """[b] the sequence log-likelihood estimate: the mean over the MC samples (sequence-level samplers)."""
        return self.logp.mean(dim=1)


@torch.no_grad()
def old_policy(sampler: Sampler, policy: nn.Module, mb: RolloutBatch, steps: Tensor, keep_mean: bool,
               keep_tokens: bool = False) -> OldPolicy:
    """log-probs [b,T] at `steps` (0 elsewhere); with `keep_mean`, the Gaussian step means [b,T,...]; with
    `keep_tokens` (masked diffusion), every MC sample's per-token log-probs [b,T,L]."""
    lp = torch.zeros_like(mb.old_logp)
    mean = torch.zeros_like(mb.traj[:, 1:]) if keep_mean else None
    tokens = None
    if keep_tokens:
        tokens = torch.zeros(*mb.old_logp.shape, mb.samples.shape[1], dtype=lp.dtype, device=lp.device)
    for s in steps.tolist():
        step = sampler.log_prob(policy, mb, s)
        lp[:, s] = step.logp
        if mean is not None:
            mean[:, s] = step.mean
        if tokens is not None:
            tokens[:, s] = step.token_logp
    return OldPolicy(lp, mean, token_logp=tokens)


@torch.no_grad()
def reference_sequence_logp(sampler: Sampler, reference: nn.Module, mb: RolloutBatch, steps: Tensor) -> Tensor:
    """[b] the reference's sequence estimate: its mean over the MC samples `steps`."""
    return torch.stack([sampler.log_prob(reference, mb, s).logp for s in steps.tolist()], dim=1).mean(dim=1)


@torch.no_grad()
def recorded_noise(sampler, policy: nn.Module, mb: RolloutBatch, backprop_steps: int) -> list[Tensor]:
    """The noise z of each of the last `backprop_steps` stored transitions under `policy` (a Gaussian sampler)."""
    T = len(sampler.timesteps)
    return [sampler.recorded_noise(policy, mb, k) for k in range(T - backprop_steps, T)]


class RecomputeAlarm:
    """max |recomputed - rollout| old log-prob over the trained steps of samples from the current policy (a
    lagged sample's gap is its lag, not an alarm; a sample without rollout log-probs, NaN, has none); above
    `threshold` the weights or numerics are off."""

    def __init__(self, threshold: float):
        self.threshold = threshold
        self.gaps: list[Tensor] = []
        self.token_gaps: list[Tensor] = []

    def observe(self, old: OldPolicy, mb: RolloutBatch, current: Tensor, steps: Tensor) -> None:
        if not current.any():
            return
        lp, rows = old.logp, current.to(old.logp.device)
        rows = rows & mb.old_logp.isfinite().all(dim=1).to(rows.device)  # an engine without likelihoods gives NaN
        if not rows.any():
            return
        self.gaps.append((lp[:, steps] - mb.old_logp[:, steps])[rows].abs().max())
        sampled = mb.extras.get(BEHAVIOUR_TOKEN_LOGP)  # [b, L], 0 at unscored positions (as the recompute's)
        if sampled is not None and old.token_logp is not None:
            self.token_gaps.append((old.token_logp[:, 0] - sampled.to(lp))[rows].abs().max())

    def metrics(self) -> dict[str, float]:
        absdiff = float(torch.stack(self.gaps).max()) if self.gaps else 0.0
        extra = {"policy/rollout_token_logp_absdiff_max": float(torch.stack(self.token_gaps).max())} \
            if self.token_gaps else {}
        if absdiff > self.threshold:
            log.warning("recomputed old log-probs differ from the rollout's by %.2e (> %.0e): policy "
                        "weights out of sync or numerics drift", absdiff, self.threshold)
        return {"policy/rollout_logp_absdiff_max": absdiff,
                "policy/rollout_logp_alarm": float(absdiff > self.threshold), **extra}


class BehaviourWeights:
    """Behaviour weights of lagged samples (`mb.old_logp` is then the behaviour policy's, kept beside the
    recomputed proximal one), and their statistics over the update."""

    def __init__(self, cap: float):
        self.cap = cap
        self.lagged: list[Tensor] = []

    def weigh(self, old: OldPolicy, mb: RolloutBatch, lagged: Tensor, steps: Tensor, sequence: bool) -> Tensor | None:
        """[b,T] per term (sequence-level: [b] from the MC means); None when no sample lags."""
        if not lagged.any():
            return None
        if sequence:
            w = behaviour_weight(old.sequence_logp, mb.old_logp.mean(dim=1), lagged, self.cap)
            self.lagged.append(w[lagged.to(old.logp.device)])
        else:
            w = behaviour_weight(old.logp, mb.old_logp, lagged, self.cap)
            self.lagged.append(w[lagged.to(old.logp.device)][:, steps].flatten())
        return w

    def metrics(self) -> dict[str, float]:
        w = torch.cat(self.lagged) if self.lagged else torch.ones(1)
        return {"async/behaviour_weight_mean": float(w.mean()), "async/behaviour_weight_max": float(w.max()),
                "async/behaviour_weight_min": float(w.min()),
                "async/behaviour_weight_capped": float((w >= self.cap).double().mean())}


@torch.no_grad()
def kl_monitor(ctx: UpdateContext, mb: RolloutBatch, old: OldPolicy | None) -> Tensor:
    """[b] KL(pi_theta || pi_ref): sequence-level, k3 of the sequence estimates; else at one random trained step
    per sample (drawn from the learner's generator)."""
    if ctx.sequence_level:
        return ctx.sampler.kl(LogProb(old.sequence_logp), LogProb(old.ref_logp))
    steps = ctx.train_steps
    s = steps[torch.randint(len(steps), (len(mb),), generator=ctx.generator)]
    return ctx.kl_to_reference(mb, s)


@torch.no_grad()
def recompute_old(ctx: UpdateContext, micro: list[RolloutBatch], updates: int,
                  cfg: LearnerConfig) -> tuple[list[OldPolicy], dict[str, float]]:
    """The old policy of every micro-batch (`updates`: the learner's version, for staleness), and the metrics."""
    steps, sequence, objective = ctx.train_steps, ctx.sequence_level, ctx.objective
    if objective.mode == "forward_process":  # DiffusionNFT reads no log-probs: only the KL monitor
        kls = torch.cat([kl_monitor(ctx, mb, None) for mb in micro])
        return [OldPolicy(torch.zeros_like(mb.old_logp)) for mb in micro], {"policy/kl_ref_monitor": float(kls.mean())}
    alarm, weights = RecomputeAlarm(cfg.logp_alarm), BehaviourWeights(cfg.behaviour_weight_cap)
    olds, kls, engine_samples = [], [], False
    for mb in micro:
        keep_tokens = objective.token_level or BEHAVIOUR_TOKEN_LOGP in mb.extras
        old = old_policy(ctx.sampler, ctx.policy, mb, steps, objective.needs_old_mean, keep_tokens)
        if sequence:
            old.ref_logp = reference_sequence_logp(ctx.sampler, ctx.reference, mb, steps)
        if isinstance(objective, RewardBackpropObjective):
            old.noise = recorded_noise(ctx.sampler, ctx.policy, mb, objective.cfg.backprop_steps)
        lagged = staleness(mb, updates) > 0
        alarm.observe(old, mb, ~lagged, steps)
        engine = mb.extras.get(BEHAVIOUR_ENGINE)
        engine = torch.zeros_like(lagged) if engine is None else engine.cpu().bool()
        engine_samples |= bool(engine.any())
        old.behaviour_weight = weights.weigh(old, mb, lagged | engine, steps, sequence)
        olds.append(old)
        kls.append(kl_monitor(ctx, mb, old))
    metrics = {**alarm.metrics(), "policy/kl_ref_monitor": float(torch.cat(kls).mean())}
    if cfg.max_staleness > 0 or engine_samples:
        metrics.update(weights.metrics())
    return olds, metrics
