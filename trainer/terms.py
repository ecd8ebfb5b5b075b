"""The learner's four term producers, one per update path (trainer/update_path.py picks it: `PRODUCERS`). A producer is built for one optimisation step (a
group of micro-batches and their recomputed old policies); building it draws the step's randomness from the
learner's generator. It then gives the objective the step's terms as `TermInputs`: `prepare_terms()`, every
piece without gradient (for `Objective.prepare`), and, iterated, the `count` pieces to back-propagate one by
one, in order (the optimiser steps after the last); `piece(key, part)` gives one piece, or the rows `part` of it
(a piece split to fit memory, trainer/memory_split.py).

  PerStepTerms         per-step likelihood ratios (Gaussian samplers; BGPO's per-MC-sample bound on dLLMs): each
                       sample trains a random `timestep_fraction` of the trained steps (dLLMs: all n MC samples);
                       one piece per (micro-batch, j-th drawn step); n_terms = samples x steps per sample
  SequenceTerms        dLLM sequence ratios (`ratio_scope = "sequence"`): one piece per (micro-batch, MC sample),
                       linearised so the pieces' gradients sum to the sequence objective's; n_terms = sequences
  RewardBackpropTerms  DRaFT-K: one piece per micro-batch, x_0 re-run through the last K steps with gradients and
                       the reward's gradient at it; n_terms = samples
  ForwardProcessTerms  DiffusionNFT: the clean samples re-noised at drawn grid values of the sampler, the policy's,
                       old policy's and reference's velocities there; one piece per (micro-batch, j-th grid value);
                       n_terms = samples x grid values per sample

n_terms and `rows` count every rank's samples of the step (`rows`: rank 0's first).
"""
from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.sampler import LogProb, Sampler, StepLogProb
from steadyrl.trainer.context import DifferentiableReward, UpdateContext
from steadyrl.trainer.distributed import step_extent
from steadyrl.trainer.objectives import Objective, TermInputs
from steadyrl.trainer.recompute import OldPolicy
from steadyrl.trainer.update_path import Producer, update_path


class TermProducer(ABC):
    """One optimisation step's terms (module docstring)."""

    count: int  # pieces to back-propagate
    rows_before: int  # the step's samples on lower ranks (`prepare_terms` rows are this rank's, from 0)

    def __init__(self, ctx: UpdateContext, group: list[RolloutBatch], olds: list[OldPolicy]):
        self.ctx, self.group, self.olds = ctx, group, olds

    def prepare_terms(self) -> list[TermInputs]:
        """Every piece of the step on this rank, without gradient, at the current weights."""
        return []

    def keys(self) -> list[tuple[int, int]]:
        """The pieces to back-propagate, in order: (micro-batch, its j-th term: drawn step or MC sample)."""
        per = self.count // len(self.group)
        return [(m, j) for m in range(len(self.group)) for j in range(per)]

    def __iter__(self) -> Iterator[TermInputs]:
        """The pieces to back-propagate, with gradient, in order."""
        for key in self.keys():
            yield self.piece(key)

    @abstractmethod
    def piece(self, key: tuple[int, int], part: Tensor | None = None) -> TermInputs:
        """Piece `key` with gradient; `part`: only these rows of its micro-batch (local indices), the piece split
        to fit memory (trainer/memory_split.py). Every random draw was made when the producer was built, so a
        part is the whole piece's rows `part`."""

    def piece_rows(self, key: tuple[int, int]) -> int:
        """Rows (samples) of piece `key`."""
        return len(self.group[key[0]])

    def _global_rows(self) -> list[Tensor]:
        """Each micro-batch's rows within the optimisation step, after the lower ranks' samples."""
        offsets = [self.rows_before + sum(len(mb) for mb in self.group[:i]) for i in range(len(self.group))]
        return [off + torch.arange(len(mb)) for off, mb in zip(offsets, self.group)]


def with_new_policy_masks(ctx: UpdateContext, group: list[RolloutBatch]) -> list[RolloutBatch]:
    """Sequence-level samplers with `masks: independent`: the new policy's MC masks, fresh per optimisation step
    (from the learner's generator); the old policy keeps the rollout's."""
    sampler = ctx.sampler
    if sampler.sequence_level and sampler.independent_masks:
        return [sampler.with_fresh_masks(mb, ctx.generator) for mb in group]
    return group


class PerStepTerms(TermProducer):
    """Per-step likelihood-ratio terms: each sample at `steps_per_sample` of the trained steps drawn at random."""

    def __init__(self, ctx: UpdateContext, group: list[RolloutBatch], olds: list[OldPolicy]):
        super().__init__(ctx, with_new_policy_masks(ctx, group), olds)
        steps = ctx.train_steps
        self.steps_per_sample = n = steps_per_sample(ctx)
        self.chosen = [torch.stack([steps[torch.randperm(len(steps), generator=ctx.generator)][:n]
                                    for _ in range(len(mb))]) for mb in self.group]  # [b, n] per micro-batch
        total, self.rows_before = step_extent(sum(len(mb) for mb in self.group))
        self.n_terms = total * n
        self.count = len(self.group) * n

    def prepare_terms(self) -> list[TermInputs]:
        pieces, offset = [], 0
        with torch.no_grad():
            for mb, old, chosen in zip(self.group, self.olds, self.chosen):
                rows = offset + torch.arange(len(mb))
                pieces += [self._term(mb, old, chosen[:, j], rows, grad=False) for j in range(chosen.shape[1])]
                offset += len(mb)
        return pieces

    def piece(self, key: tuple[int, int], part: Tensor | None = None) -> TermInputs:
        m, j = key
        mb, rows, step = self.group[m], self._global_rows()[m], self.chosen[m][:, j]
        if part is not None:
            mb, rows, step = mb.index(part), rows[part], step[part]
        return self._term(mb, self.olds[m], step, rows, grad=True, local=part)

    def _term(self, mb: RolloutBatch, old: OldPolicy, step: Tensor, rows: Tensor, grad: bool,
              local: Tensor | None = None) -> TermInputs:
        """The micro-batch at `step` [b]; with `grad`, the term `loss` sees (KL to the reference where asked).
        `local`: `mb`'s rows in `old` (a part of a split piece; None: all)."""
        ctx = self.ctx
        local = torch.arange(len(mb)) if local is None else local
        new = ctx.sampler.log_prob(ctx.policy, mb, step, **entropy_request(ctx, grad))
        ref = ctx.reference_log_prob(mb, step) if grad and ctx.objective.needs_reference else None
        kl = None if ref is None else ctx.kl_to_reference(mb, step, new, ref)
        inputs = TermInputs(n_terms=self.n_terms, rows=rows, new_logp=new.logp, old_logp=old.logp[local, step],
                            advantages=old.weighted(mb.advantages, local, step), step=step, group=mb.group,
                            kl_ref=kl, micro=mb if grad else None, reduce=ctx.sampler.reduce)
        if ctx.objective.token_level:  # per-token ratios (masked diffusion): new, old and reference token terms
            inputs.tokens, inputs.old_tokens = new, old.token_logp[local, step]
            inputs.ref_tokens = None if ref is None else ref.token_logp
        if grad and getattr(new, "entropy", None) is not None:  # one row entropy per term: n_terms of them
            inputs.entropy, inputs.entropy_terms = new.entropy, self.n_terms
        if isinstance(new, StepLogProb):
            inputs.std, inputs.dt, inputs.new_mean = new.std, new.dt, new.mean
            inputs.old_mean = None if old.mean is None else old.mean[local, step]
        return inputs


def fraction_of_steps(n: int, timestep_fraction: float) -> int:
    """Trained steps per sample out of `n` trainable ones: max(1, round(timestep_fraction x n))."""
    return max(1, round(timestep_fraction * n))


def steps_per_sample(ctx: UpdateContext) -> int:
    """Trained steps per sample and optimisation step: a `timestep_fraction` of them (at least one); every MC
    sample on a sequence-level sampler."""
    n = len(ctx.train_steps)
    return n if ctx.sequence_level else fraction_of_steps(n, ctx.objective.cfg.timestep_fraction)


class SequenceTerms(TermProducer):
    """Sequence-level ratios f(log rho) over MC-estimated likelihoods, exactly, in one backward per MC sample.

    log pi(y) is estimated by ell_bar = (1/n) sum_j ell_j over the n MC mask samples. A no-grad pass
    computes ell_bar at the current weights; then each MC sample j is back-propagated on its own with

        new_logp_j = sg(ell_bar) + (ell_j - sg(ell_j)) / n       value ell_bar, gradient grad(ell_j) / n

    so the objective is evaluated at the exact sequence ratio and the pieces' gradients sum to
    f'(ell_bar) grad(ell_bar): the exact objective's gradient in n backward passes, with memory of one
    (the two-pass form; BGPO's bound is the per-term alternative). `n_terms` counts sequences.
    """

    def __init__(self, ctx: UpdateContext, group: list[RolloutBatch], olds: list[OldPolicy]):
        super().__init__(ctx, with_new_policy_masks(ctx, group), olds)
        self.mc_samples = n = len(ctx.train_steps)
        with torch.no_grad():
            self.passes = [[ctx.sampler.log_prob(ctx.policy, mb, j) for j in range(n)] for mb in self.group]
        self.current = [torch.stack([p.logp for p in mc], 1).mean(1) for mc in self.passes]  # ell_bar [b]
        self.n_terms, self.rows_before = step_extent(sum(len(mb) for mb in self.group))
        self.count = len(self.group) * n

    def prepare_terms(self) -> list[TermInputs]:
        """One piece per micro-batch: the sequence estimates, and every MC sample's token terms (`tokens`)."""
        pieces, offset = [], 0
        for mb, old, current, mc in zip(self.group, self.olds, self.current, self.passes):
            pieces.append(TermInputs(n_terms=self.n_terms, rows=offset + torch.arange(len(mb)), new_logp=current,
                                     old_logp=old.sequence_logp, advantages=old.weighted(mb.advantages),
                                     group=mb.group, reduce=self.ctx.sampler.reduce, tokens=list(mc)))
            offset += len(mb)
        return pieces

    def piece(self, key: tuple[int, int], part: Tensor | None = None) -> TermInputs:
        ctx, n, (m, j) = self.ctx, self.mc_samples, key
        mb, old, rows = self.group[m], self.olds[m], self._global_rows()[m]
        current, old_logp, adv, ref = self.current[m], old.sequence_logp, old.weighted(mb.advantages), old.ref_logp
        if part is not None:
            mb, rows, current, old_logp, adv = mb.index(part), rows[part], current[part], old_logp[part], adv[part]
            ref = None if ref is None else ref[part]
        new = ctx.sampler.log_prob(ctx.policy, mb, j, **entropy_request(ctx, True))
        linear = current + (new.logp - new.logp.detach()) / n
        kl = None
        if ctx.objective.needs_reference:
            kl = ctx.sampler.kl(LogProb(linear), LogProb(ref))
        step = torch.full((len(mb),), j, dtype=torch.long)
        return TermInputs(n_terms=self.n_terms, rows=rows, new_logp=linear, old_logp=old_logp, advantages=adv,
                          step=step, group=mb.group, kl_ref=kl, micro=mb, reduce=ctx.sampler.reduce, tokens=new,
                          entropy=new.entropy, entropy_terms=self.n_terms * n)  # a row entropy per (sequence, MC)


class RewardBackpropTerms(TermProducer):
    """Reward back-propagation through the last K = `backprop_steps` sampling steps (DRaFT-K): each micro-batch
    re-runs them from the stored x_K with the recorded noise and gradients through the policy; the piece holds
    x_0, the differentiable reward's gradient G = dr/dx_0 there and r(x_0). The objective's surrogate
    -sum <regulate(G), x_0> / n_terms then has gradient -grad mean_i r(x0_i) when G is not rescaled."""

    def __init__(self, ctx: UpdateContext, group: list[RolloutBatch], olds: list[OldPolicy]):
        super().__init__(ctx, group, olds)
        self.first = len(ctx.sampler.timesteps) - ctx.objective.cfg.backprop_steps
        self.n_terms, self.rows_before = step_extent(sum(len(mb) for mb in group))
        self.count = len(group)

    def piece(self, key: tuple[int, int], part: Tensor | None = None) -> TermInputs:
        ctx, m = self.ctx, key[0]
        mb, rows, noise = self.group[m], self._global_rows()[m], self.olds[m].noise or []
        if part is not None:
            mb, rows, noise = mb.index(part), rows[part], [z[part.to(z.device)] for z in noise]
        x0 = ctx.sampler.denoise_from(ctx.policy, mb, self.first, noise)
        leaf = x0.detach().requires_grad_(True)
        reward = ctx.reward_fn(leaf, mb.cond)
        (grad,) = torch.autograd.grad(reward.sum(), leaf)
        return TermInputs(n_terms=self.n_terms, rows=rows, micro=mb, reduce=ctx.sampler.reduce, sample=x0,
                          reward_grad=grad, reward=reward.detach())


class ForwardProcessTerms(TermProducer):
    """Forward-process terms (DiffusionNFT): no log-probs, the clean samples x0 = `mb.samples` re-noised.

    Each sample trains on n = max(1, floor(T * timestep_fraction)) grid values of the sampler's own T steps, the
    first n of a random permutation of 0..T-1 per sample (t = 1 included), each with fresh noise eps:

        t = sigmas[k],   x_t = (1 - t) x0 + t eps,   v_theta = v(x_t, k) with grad,   v_old, v_ref without

    (the sampler's `velocity` seam; old: the objective's copy of the sampling policy, `old_network`). One piece per
    (micro-batch, j-th drawn grid value); n_terms = samples x n. Every draw is made at construction.
    """

    def __init__(self, ctx: UpdateContext, group: list[RolloutBatch], olds: list[OldPolicy]):
        super().__init__(ctx, group, olds)
        grid = len(ctx.sampler.timesteps)
        self.steps_per_sample = n = max(1, math.floor(grid * ctx.objective.cfg.timestep_fraction))
        gen = ctx.generator
        self.chosen = [torch.stack([torch.randperm(grid, generator=gen)[:n] for _ in range(len(mb))])
                       for mb in group]  # [b, n] grid indices per micro-batch
        self.noise = [torch.randn((n, *mb.samples.shape), generator=gen, dtype=mb.samples.dtype) for mb in group]
        total, self.rows_before = step_extent(sum(len(mb) for mb in group))
        self.n_terms = total * n
        self.count = len(group) * n
        self.old_net = ctx.objective.old_network(getattr(ctx.policy, "module", ctx.policy))

    def piece(self, key: tuple[int, int], part: Tensor | None = None) -> TermInputs:
        ctx, (m, j) = self.ctx, key
        mb, rows, step, eps = self.group[m], self._global_rows()[m], self.chosen[m][:, j], self.noise[m][j]
        if part is not None:
            mb, rows, step, eps = mb.index(part), rows[part], step[part], eps[part]
        x0 = mb.samples
        t = ctx.sampler.sigmas[step].to(device=x0.device, dtype=x0.dtype)
        t_b = t.view(-1, *([1] * (x0.dim() - 1)))
        x_t = (1 - t_b) * x0 + t_b * eps.to(x0.device)  # x_t = (1 - t) x0 + t eps
        cond = mb.model_cond
        v = ctx.sampler.velocity(ctx.policy, x_t, step, cond)
        with torch.no_grad():
            v_old = ctx.sampler.velocity(self.old_net, x_t, step, cond)
            v_ref = ctx.sampler.velocity(ctx.reference, x_t, step, cond) if ctx.objective.needs_reference else None
        return TermInputs(n_terms=self.n_terms, rows=rows, advantages=mb.advantages, step=step, group=mb.group,
                          micro=mb, x0=x0, t=t, x_t=x_t, velocity=v, old_velocity=v_old, ref_velocity=v_ref)


def entropy_request(ctx: UpdateContext, grad: bool) -> dict[str, bool]:
    """The keyword that asks a language-model sampler's `log_prob` for token entropies: only for the pieces
    back-propagated with an entropy bonus (`objective.entropy_coef` > 0), so no other pass pays for them."""
    return {"entropy": True} if grad and ctx.objective.cfg.entropy_coef > 0 else {}


PRODUCERS: dict[Producer, type[TermProducer]] = {
    "per_step": PerStepTerms, "sequence": SequenceTerms, "reward_backprop": RewardBackpropTerms,
    "forward_process": ForwardProcessTerms}


def term_producer(objective: Objective, sampler: Sampler, reward_fn: DifferentiableReward | None) -> type[TermProducer]:
    """The term producer of the update path `objective` takes on `sampler` (trainer/update_path.py, the check the
    config ran before anything started); reward back-propagation needs the learner's differentiable reward."""
    path = update_path(type(objective), objective.cfg, sampler.cfg)
    if path == "reward_backprop" and reward_fn is None:
        raise ValueError(f"objective {objective.cfg.name!r} back-propagates a reward: the learner needs a "
                         "differentiable reward_fn")
    return PRODUCERS[path]
