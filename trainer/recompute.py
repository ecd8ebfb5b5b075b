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
  RolloutLogpTrust         `learner.old_logp: auto`: between checks, the rollout's own log-probs of current samples
                           stand in for old_policy's (`rollout_old_policy`) while the last check found them equal

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


def rollout_old_policy(mb: RolloutBatch, steps: Tensor) -> OldPolicy:
    """The rollout's log-probs [b,T] at `steps` (0 elsewhere, as `old_policy` leaves them): the old policy when the
    samples are the current policy's and the rollout computed them as the learner would (`RolloutLogpTrust`)."""
    lp = torch.zeros_like(mb.old_logp)
    lp[:, steps] = mb.old_logp[:, steps]
    return OldPolicy(lp)


class RolloutLogpTrust:
    """`learner.old_logp`: whether an update may skip the pre-pass's log-prob recompute for current samples.

    recompute: never. auto: an update recomputes (a check) when `updates % check_every == 0` or the last check's
    gap max |recomputed - rollout| exceeded `tol` (or none was made); otherwise micro-batches whose samples are all
    the current policy's take `rollout_old_policy`. The state is the last check's verdict (checkpointed), and
    the verdict comes from the rank-reduced gap, so every rank decides alike."""

    def __init__(self, mode: str, check_every: int, tol: float):
        self.mode, self.check_every, self.tol = mode, check_every, tol
        self.trusted = False

    def recompute_due(self, updates: int) -> bool:
        return self.mode == "recompute" or not self.trusted or updates % self.check_every == 0

    def observe(self, metrics: dict[str, float]) -> None:
        """After an update that checked (`policy/rollout_logp_checked` > 0), the verdict on its gap."""
        if self.mode == "auto" and metrics.get("policy/rollout_logp_checked", 0.0) > 0:
            self.trusted = metrics["policy/rollout_logp_absdiff_max"] <= self.tol

    def state_dict(self) -> dict[str, bool]:
        return {"trusted": self.trusted}

    def load_state_dict(self, state: dict[str, bool]) -> None:
        self.trusted = bool(state["trusted"])


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
        """The gap (0 with nothing compared), its alarm, and whether anything was compared (`_checked`)."""
        absdiff = float(torch.stack(self.gaps).max()) if self.gaps else 0.0
        extra = {"policy/rollout_token_logp_absdiff_max": float(torch.stack(self.token_gaps).max())} \
            if self.token_gaps else {}
        if absdiff > self.threshold:
            log.warning("recomputed old log-probs differ from the rollout's by %.2e (> %.0e): policy "
                        "weights out of sync or numerics drift", absdiff, self.threshold)
        return {"policy/rollout_logp_absdiff_max": absdiff, "policy/rollout_logp_checked": float(bool(self.gaps)),
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


def trusts_rollout(ctx: UpdateContext, mb: RolloutBatch, lagged: Tensor, engine: Tensor) -> bool:
    """Whether `rollout_old_policy` gives the old log-probs the pre-pass would for `mb`: every sample the current
    policy's, with finite log-probs, for an objective that reads no old step means, per-token terms or noise."""
    objective = ctx.objective
    if objective.needs_old_mean or objective.token_level \
            or isinstance(objective, RewardBackpropObjective) or BEHAVIOUR_TOKEN_LOGP in mb.extras:
        return False
    return not bool((lagged | engine).any()) and bool(mb.old_logp[:, ctx.train_steps].isfinite().all())


@torch.no_grad()
def recompute_old(ctx: UpdateContext, micro: list[RolloutBatch], updates: int, cfg: LearnerConfig,
                  recompute: bool = True) -> tuple[list[OldPolicy], dict[str, float]]:
    """The old policy of every micro-batch (`updates`: the learner's version, for staleness), and the metrics.
    `recompute=False` (`RolloutLogpTrust.recompute_due` said no): micro-batches that `trusts_rollout` take the
    rollout's log-probs; `policy/old_logp_recomputed` is the share of micro-batches recomputed."""
    steps, sequence, objective = ctx.train_steps, ctx.sequence_level, ctx.objective
    if objective.update_path == "forward_process":  # DiffusionNFT reads no log-probs: only the KL monitor
        kls = torch.cat([kl_monitor(ctx, mb, None) for mb in micro])
        return [OldPolicy(torch.zeros_like(mb.old_logp)) for mb in micro], {"policy/kl_ref_monitor": float(kls.mean())}
    alarm, weights = RecomputeAlarm(cfg.logp_alarm), BehaviourWeights(cfg.behaviour_weight_cap)
    olds, kls, engine_samples, recomputed = [], [], False, 0
    for mb in micro:
        lagged = staleness(mb, updates) > 0
        engine = mb.extras.get(BEHAVIOUR_ENGINE)
        engine = torch.zeros_like(lagged) if engine is None else engine.cpu().bool()
        if not recompute and trusts_rollout(ctx, mb, lagged, engine):
            old = rollout_old_policy(mb, steps)  # all current samples: no behaviour weight, nothing to compare
        else:
            recomputed += 1
            keep_tokens = objective.token_level or BEHAVIOUR_TOKEN_LOGP in mb.extras
            old = old_policy(ctx.sampler, ctx.policy, mb, steps, objective.needs_old_mean, keep_tokens)
            if isinstance(objective, RewardBackpropObjective):
                old.noise = recorded_noise(ctx.sampler, ctx.policy, mb, objective.cfg.backprop_steps)
            alarm.observe(old, mb, ~lagged, steps)
            engine_samples |= bool(engine.any())
            old.behaviour_weight = weights.weigh(old, mb, lagged | engine, steps, sequence)
        if sequence:  # the reference's estimate either way (KL monitor and penalty)
            old.ref_logp = reference_sequence_logp(ctx.sampler, ctx.reference, mb, steps)
        olds.append(old)
        kls.append(kl_monitor(ctx, mb, old))
    metrics = {**alarm.metrics(), "policy/kl_ref_monitor": float(torch.cat(kls).mean()),
               "policy/old_logp_recomputed": recomputed / len(micro)}
    if cfg.max_staleness > 0 or engine_samples:
        metrics.update(weights.metrics())
    return olds, metrics
