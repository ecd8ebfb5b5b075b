"""The sampler seam: `Sampler`, what the learner and the rollout workers use from every sampler, and its
Gaussian family, where each denoising step is a Gaussian N(mean, std^2 I).

`Sampler` (a Protocol) is the whole of what every sampler shares: `cfg`, `timesteps`, `trainable`,
`sequence_level`, `reduce`, `train_steps(min_std)`, `sample(...) -> RolloutBatch`,
`log_prob(policy, batch, step) -> LogProb` and `kl(new, ref)`. Each family's `log_prob` returns its own
result: `StepLogProb` (logp, mean, std, dt) for the Gaussian family, `rollout.likelihood.SequenceLogProb`
(logp and the estimator's per-token terms) for masked diffusion; `LogProb` (logp only) is what both extend.
Sequence-level samplers also implement `SequenceSampler` (fresh MC masks per optimisation step).

Every image sampler (DDIM, flow-SDE) is a `GaussianStepSampler`: it owns a schedule
(`timesteps`, per-step `std`, per-step `dt`, which steps are stochastic) and one small
scheduler-like function, `step_distribution(policy, x_t, step, cond)`, from which sampling,
the log-prob recompute, the KL between two policies and reward back-propagation all follow.
The learner only ever talks to these interfaces, never to a concrete sampler; the sampler only ever
calls `policy(x_t, t, cond)` (`rollout.policy.Policy`), never a network. The schedule lives on the CPU
in float64; each step's coefficients move to x_t's device and dtype, and noise is drawn from a CPU
generator and moved, so a seed gives the same trajectory on any device up to the network's numerics.

    log pi(x_next | x_t) = log N(x_next; mean, std^2 I), reduced over pixels by `mean` or `sum`
    KL(p || q) at one step (same std) = ||mean_p - mean_q||^2 / (2 std^2)   (same reduction)
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch, cond_extras
from steadyrl.rollout.policy import Cond, module_device

if TYPE_CHECKING:
    from steadyrl.rollout.likelihood import SequenceLogProb

ConditionalModel = nn.Module  # a `rollout.policy.Policy`, or a DeepSpeed engine wrapping one


def gaussian_logp(x: Tensor, mean: Tensor, std: Tensor, reduce: str) -> Tensor:
    """log N(x; mean, std^2 I) per sample, reduced over non-batch dims by `mean` or `sum`; `std` is [B]."""
    std = std.view(-1, *([1] * (x.dim() - 1)))
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    dims = tuple(range(1, x.dim()))
    return lp.mean(dim=dims) if reduce == "mean" else lp.sum(dim=dims)


def reduce_pixels(values: Tensor, reduce: str) -> Tensor:
    """Mean or sum over every non-batch dimension ([B,...] -> [B])."""
    dims = tuple(range(1, values.dim()))
    return values.mean(dim=dims) if reduce == "mean" else values.sum(dim=dims)


@dataclass
class StepDistribution:
    """pi(. | x_t) at one step for a batch: N(mean [B,...], std [B]^2 I)."""

    mean: Tensor
    std: Tensor

    def log_prob(self, x_next: Tensor, reduce: str) -> Tensor:
        return gaussian_logp(x_next, self.mean, self.std, reduce)


@dataclass
class LogProb:
    """A recomputed log-likelihood [B] of stored samples: what every sampler's `log_prob` returns (and all a
    sequence-level KL needs)."""

    logp: Tensor


@dataclass
class StepLogProb(LogProb):
    """A recomputed Gaussian step: log-prob [B] of the stored transition, the distribution it came from,
    N(mean [B,...], std [B]^2 I), and the step's length dt [B] (|Delta t| in the model's continuous time)."""

    mean: Tensor
    std: Tensor
    dt: Tensor


@runtime_checkable
class Sampler(Protocol):
    """What the learner and the rollout workers use from every sampler (attributes are per inference step,
    or per MC sample for a sequence-level sampler: [T]).

    cfg: its settings.  timesteps [T]: model timestep (or MC sample index) per step.  trainable [T] (bool): the
    step carries a log-prob.  sequence_level: the steps are MC samples of one sequence likelihood (the learner
    uses their mean as one ratio) rather than each its own ratio.  reduce: the log-prob reduction.
    """

    cfg: Any
    timesteps: Tensor
    trainable: Tensor
    sequence_level: bool

    @property
    def reduce(self) -> str:
        """How log-probs (and KLs) are reduced over a sample's elements: `mean` or `sum`."""

    def train_steps(self, min_std: float = 0.0) -> Tensor:
        """Indices of the steps a learner trains."""

    def sample(self, policy: nn.Module, cond: Tensor, n_per_cond: int, generator: torch.Generator, *,
               group_offset: int = 0) -> RolloutBatch:
        """`n_per_cond` samples per entry of `cond`, one group each (numbered from `group_offset`), with their
        log-probs as `old_logp`; a sampler may take further keyword options (image shape, embeddings)."""

    def log_prob(self, policy: nn.Module, batch: RolloutBatch, step: Tensor | int) -> LogProb:
        """Recompute the stored samples' log-probs [B] at step(s) `step` (int or [B]) under `policy`."""

    def kl(self, new: Any, ref: Any) -> Tensor:
        """KL(pi_new || pi_ref) per sample [B] from two `log_prob` results (of this sampler's kind)."""


@runtime_checkable
class SequenceSampler(Sampler, Protocol):
    """A sequence-level sampler (masked diffusion): `log_prob` is one MC sample of the sequence likelihood and
    the MC masks may be redrawn for the new policy."""

    def log_prob(self, policy: nn.Module, batch: RolloutBatch, step: Tensor | int,
                 entropy: bool = False) -> SequenceLogProb:
        """The estimator at MC sample(s) `step`: logp [B] and its per-token terms; with `entropy`, also each row's
        mean token entropy over the scored positions (`SequenceLogProb.entropy`, for the entropy bonus)."""

    @property
    def independent_masks(self) -> bool:
        """The new policy is evaluated on masks of its own, drawn per optimisation step (`with_fresh_masks`)."""

    def with_fresh_masks(self, batch: RolloutBatch, generator: torch.Generator) -> RolloutBatch:
        """The batch with newly drawn MC masks."""


class TailSolver(Protocol):
    """Finishes a rollout from step `first_step` on, deterministically and untrained (rollout/dpm_solver.py):
    `tail(x, cond)` returns the final sample from the state x at step `first_step`."""

    first_step: int

    def __call__(self, x: Tensor, cond: Cond) -> Tensor: ...


class GaussianStepSampler(ABC):
    """The Gaussian family of `Sampler`: shared sampling / recompute logic over a schedule; subclasses define
    the schedule and `step_distribution`. Attributes (all [T], T = num inference steps):

    timesteps: model timestep per step.  std: the step's Gaussian std (float64).
    dt: |Delta t| of the step in the model's continuous time (flow: |s_next - s|; DDIM: (t - t_prev)/T_train).
    trainable: the step is stochastic (std >= cfg.min_std) and carries a log-prob.
    """

    cfg: Any
    timesteps: Tensor
    std: Tensor
    dt: Tensor
    trainable: Tensor
    sequence_level = False  # each step is its own ratio (masked diffusion: the mean over its steps is one)

    @property
    def reduce(self) -> str:
        return self.cfg.logp_reduce

    @property
    def trainable_steps(self) -> Tensor:
        """Indices of the stochastic (trainable) inference steps."""
        return torch.nonzero(self.trainable).flatten()

    def train_steps(self, min_std: float = 0.0) -> Tensor:
        """Stochastic steps whose std is at least `min_std` (the steps a learner trains)."""
        steps = torch.nonzero(self.trainable & (self.std >= min_std)).flatten()
        if len(steps) == 0:
            raise ValueError(f"objective.train_min_std={min_std} leaves no step to train "
                             f"(step stds: {[round(float(s), 4) for s in self.std]})")
        return steps

    @abstractmethod
    def step_distribution(self, policy: ConditionalModel, x_t: Tensor, step: Tensor, cond: Cond) -> StepDistribution:
        """pi(x_next | x_t) at inference-step indices `step` [B] (on the CPU); the distribution is on x_t's device."""

    def ode_mean(self, policy: ConditionalModel, x_t: Tensor, step: Tensor, cond: Cond) -> Tensor:
        """The deterministic (probability-flow ODE) step from x_t at `step` [B]; samplers with SDE windows define it."""
        raise NotImplementedError(f"{type(self).__name__} has no ODE step (no SDE window)")

    def _coef(self, values: Tensor, step: Tensor, like: Tensor) -> Tensor:
        """Per-sample schedule values at `step`, shaped to broadcast over `like` [B,...], on its device/dtype."""
        return values[step].to(device=like.device, dtype=like.dtype).view((-1,) + (1,) * (like.dim() - 1))

    @torch.no_grad()
    def sample(
        self,
        policy: ConditionalModel,
        cond: Tensor,
        n_per_cond: int,
        generator: torch.Generator,
        dtype: torch.dtype = torch.float32,
        sample_shape: tuple[int, ...] = (1, 8, 8),
        group_offset: int = 0,
        cond_inputs: dict[str, Tensor] | None = None,
        sde_steps: Tensor | None = None,
        tail: TailSolver | None = None,
    ) -> RolloutBatch:
        """Draw `n_per_cond` samples for each entry of `cond` (class or prompt ids [C]); one group per entry,
        numbered from `group_offset` (workers use distinct offsets so their batches can be joined).
        `cond_inputs` ({name: [C,...]}, e.g. text embeddings) are what the policy is conditioned on instead
        of the ids; they travel in the batch (`RolloutBatch.model_cond`). Sampling runs on the policy's
        device; the batch comes back on the CPU, ready for the object store. `sde_steps` ([T] bool, a subset of
        `trainable`; None = all of them): the steps drawn stochastically and marked trainable in the batch; the
        other stochastic steps take the sampler's deterministic `ode_mean` (an SDE window, rollout/sde_window.py).
        `tail`: a solver that takes over at step `tail.first_step` (after the last SDE step) and returns the final
        sample (MixGRPO-Flash's DPM-Solver++ on a compressed grid, rollout/dpm_solver.py); the batch's later
        states are that final sample, with no log-prob (its own grid's states are not on this one)."""
        sde = self.trainable if sde_steps is None else sde_steps.bool()
        if sde.shape != self.trainable.shape or bool((sde & ~self.trainable).any()):
            raise ValueError("sde_steps must be a [T] mask within the sampler's stochastic steps")
        if tail is not None and bool(sde[tail.first_step:].any()):
            raise ValueError(f"a tail solver from step {tail.first_step} on would skip SDE steps")
        device = module_device(policy)
        n_groups = len(cond)
        cond = cond.long().repeat_interleave(n_per_cond)
        group = (group_offset + torch.arange(n_groups)).repeat_interleave(n_per_cond)
        per_sample = {k: v.repeat_interleave(n_per_cond, dim=0) for k, v in (cond_inputs or {}).items()}
        model_cond: Cond = {k: v.to(device) for k, v in per_sample.items()} if per_sample else cond.to(device)
        B, T = len(cond), len(self.timesteps)
        x = torch.randn((B, *sample_shape), generator=generator, dtype=dtype).to(device)
        traj, logps = [x], []
        for k in range(T if tail is None else tail.first_step):
            at = torch.full((B,), k, dtype=torch.long)
            stochastic = bool(sde[k])
            if stochastic or not bool(self.trainable[k]):  # the SDE kernel (its mean where its std is ~0)
                dist = self.step_distribution(policy, x, at, model_cond)
            else:  # a stochastic step outside the SDE window: the ODE step
                dist = StepDistribution(self.ode_mean(policy, x, at, model_cond), torch.zeros(B, dtype=dtype))
            noise = torch.randn(x.shape, generator=generator, dtype=dtype).to(device) if stochastic else None
            x = self._advance(dist, k, noise)
            logps.append(dist.log_prob(x, self.reduce) if stochastic else torch.zeros(B, dtype=dtype, device=device))
            traj.append(x)
        if tail is not None:  # the rest of the grid, deterministic and untrained
            x = tail(x, model_cond)
            traj += [x] * (T - tail.first_step)
            logps += [torch.zeros(B, dtype=dtype, device=device)] * (T - tail.first_step)
        traj_cpu = torch.stack(traj, dim=1).cpu()  # one device -> host copy per rollout, not one per step
        return RolloutBatch(cond=cond, group=group, samples=traj_cpu[:, -1].clone(), traj=traj_cpu,
                            old_logp=torch.stack(logps, dim=1).cpu(), timesteps=self.timesteps.clone(),
                            trainable=sde.clone(),
                            extras=cond_extras({k: v.cpu() for k, v in per_sample.items()}))

    def _steps(self, batch: RolloutBatch, step: Tensor | int) -> Tensor:
        if isinstance(step, int):
            step = torch.full((len(batch),), step, dtype=torch.long)
        return step

    def log_prob(self, policy: ConditionalModel, batch: RolloutBatch, step: Tensor | int) -> StepLogProb:
        """Recompute log pi(x_next | x_t) [B] of the stored transition at step(s) `step` (int or [B]), with the
        step's mean, std and dt."""
        step = self._steps(batch, step)
        if not bool(self.trainable[step].all()):
            raise ValueError("log_prob asked for a deterministic (untrainable) step")
        rows = torch.arange(len(batch), device=batch.traj.device)
        at = step.to(batch.traj.device)
        dist = self.step_distribution(policy, batch.traj[rows, at], step, batch.model_cond)
        logp = dist.log_prob(batch.traj[rows, at + 1], self.reduce)
        return StepLogProb(logp, dist.mean, dist.std, self.dt[step].to(device=logp.device, dtype=logp.dtype))

    def distribution(self, policy: ConditionalModel, batch: RolloutBatch, step: Tensor | int) -> StepDistribution:
        """The step distribution at the stored x_t (e.g. of the reference policy, for a KL)."""
        step = self._steps(batch, step)
        rows = torch.arange(len(batch), device=batch.traj.device)
        return self.step_distribution(policy, batch.traj[rows, step.to(batch.traj.device)], step, batch.model_cond)

    def kl(self, new: StepLogProb, ref: StepLogProb) -> Tensor:
        """KL(N(mean_new, std^2) || N(mean_ref, std^2)) per sample [B] at one step (the reference's std;
        both policies share it), in the sampler's pixel reduction."""
        std = ref.std.view(-1, *([1] * (new.mean.dim() - 1)))
        return reduce_pixels((new.mean - ref.mean) ** 2 / (2 * std**2), self.reduce)

    @torch.no_grad()
    def recorded_noise(self, policy: ConditionalModel, batch: RolloutBatch, step: int) -> Tensor:
        """z = (x_next - mean) / std of the stored transition at `step` under `policy` (0 where deterministic)."""
        if not torch.equal(batch.trainable.cpu().bool(), self.trainable):
            raise ValueError("reward back-propagation re-runs the SDE kernel at every step: it does not support "
                             "rollouts with an SDE window (sampler.sde_window)")
        dist = self.distribution(policy, batch, step)
        if not bool(self.trainable[step]):
            return torch.zeros_like(dist.mean)
        return (batch.traj[:, step + 1] - dist.mean) / dist.std.view(-1, *([1] * (dist.mean.dim() - 1)))

    def denoise_from(self, policy: ConditionalModel, batch: RolloutBatch, first_step: int,
                     noise: list[Tensor]) -> Tensor:
        """Re-run steps first_step..T-1 from the stored x_{first_step} with the recorded noise, with
        gradients through the policy (reward back-propagation, DRaFT-K): returns x_0 [B,...]."""
        x = batch.traj[:, first_step]
        for k, z in zip(range(first_step, len(self.timesteps)), noise):
            dist = self.step_distribution(policy, x, torch.full((len(batch),), k, dtype=torch.long), batch.model_cond)
            x = self._advance(dist, k, z)
        return x

    def _advance(self, dist: StepDistribution, step: int, noise: Tensor | None) -> Tensor:
        """x_next = mean + std * noise at a stochastic step; the mean at a deterministic one."""
        if not bool(self.trainable[step]) or noise is None:
            return dist.mean
        return dist.mean + dist.std.view(-1, *([1] * (dist.mean.dim() - 1))) * noise.to(dist.mean.device)
