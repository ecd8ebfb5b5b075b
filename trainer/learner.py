"""The DeepSpeed learner: recompute old log-probs, apply the objective, step the optimiser.

One `update(batch)`:
 1. `objective.prepare_batch` on the whole batch (advantages, gates, per-sample weights);
 2. a fixed shuffle into micro-batches; a no-grad pre-pass recomputes old_logp (and, where the
    objective asks, the old step means) at every trained step with the update's own micro-batching
    (float32 numerics depend on batch shape and threads) and logs the gap to the rollout's values
    (`policy/rollout_logp_absdiff_max`);
 3. `inner_epochs` passes over optimisation steps of `optim_batch_size` samples (several
    micro-batches). Each sample trains on a random `timestep_fraction` of the trained steps; per
    optimisation step the objective may run a no-grad `prepare` over all its terms (whole-step
    normalisers), then every (micro-batch, step) piece is back-propagated and the optimiser steps once;
 4. `objective.after_update` (reference reset / EMA through `reset_reference` / `ema_reference`).

Reward back-propagation objectives (DRaFT-K, GRPO-Guard's seed form) instead re-run the last K
sampling steps with gradients and the recorded noise, and back-propagate a differentiable reward.

Masked-diffusion samplers (dLLMs) are sequence-level: their "steps" are the n MC mask samples of one
likelihood estimate. Every sample trains on all n; objectives whose ratio is the sequence's
(`ratio_scope = "sequence"`: GRPO, StableDRL) run through `_sequence_step`, which gives the exact
gradient of the one-graph objective in n backward passes; BGPO's bound is per MC sample and runs
through the per-step path. With `sampler.masks: independent` the new policy's masks are redrawn per
optimisation step (from the learner's checkpointed generator); the old policy keeps the rollout's.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.masked_diffusion import MaskedDiffusionSampler
from steadyrl.rollout.policy import load_trainable_state, make_reference, state_bytes, trainable_state
from steadyrl.rollout.sampler import GaussianStepSampler, StepLogProb
from steadyrl.trainer.balanced_gradient import (DualMomentum, RollingQuantileClipper, apply_module_precision,
                                      enable_activation_checkpointing, scale_module_gradients)
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.off_policy import behaviour_weight, check_staleness, staleness
from steadyrl.trainer.distributed import (all_gather, gather_pieces, group_shares, micro_batch_count, reduce_metrics,
                                          split_into, world)
from steadyrl.trainer.objectives import (ObjectiveSettings, PolicyGradientObjective, PreparePiece, RewardBackpropObjective,
                                StepInputs, build_objective)

log = logging.getLogger(__name__)

DifferentiableReward = Callable[[Tensor, Tensor], Tensor]  # (x_0 [B,...] with grad, cond [B]) -> [B]


def deepspeed_config(cfg: LearnerConfig) -> dict[str, Any]:
    """DeepSpeed JSON config; `torch_adam` avoids compiling the fused Adam op. The learner marks the
    gradient-accumulation boundary itself (last piece of each optimisation step). With
    `balanced.dual_momentum` the learner passes its own optimiser and this has no optimizer section."""
    out = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.micro_per_optim_step,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "betas": list(cfg.betas), "weight_decay": cfg.weight_decay,
                       "torch_adam": True},
        },
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.balanced.dual_momentum:
        del out["optimizer"]
        out["zero_allow_untested_optimizer"] = True
    return out


def communication_backend(name: str) -> str:
    """`auto`: NCCL when DeepSpeed's accelerator is cuda (DS_ACCELERATOR), gloo on the CPU."""
    if name != "auto":
        return name
    from deepspeed.accelerator import get_accelerator

    return "nccl" if get_accelerator().device_name() == "cuda" else "gloo"


@dataclass
class OldPolicy:
    """The old policy on one micro-batch, recomputed without grad at the start of an update."""

    logp: Tensor  # [b,T] (0 at untrained steps)
    mean: Tensor | None = None  # [b,T,...] where the objective needs old means
    noise: list[Tensor] | None = None  # recorded noise of the last K steps (reward back-propagation)
    ref_logp: Tensor | None = None  # [b] sequence-level samplers: the reference's mean over MC samples
    behaviour_weight: Tensor | None = None  # [b,T] (sequence-level: [b]) min(pi_prox/pi_b, c); None: all current

    def weighted(self, advantages: Tensor, rows: Tensor | None = None, step: Tensor | None = None) -> Tensor:
        """Advantages times the behaviour weight of each term (trainer/off_policy.py); unchanged when current."""
        if self.behaviour_weight is None or advantages is None:
            return advantages
        w = self.behaviour_weight if rows is None else self.behaviour_weight[rows, step]
        return advantages * w.to(advantages)

    @property
    def sequence_logp(self) -> Tensor:
        """[b] the sequence log-likelihood estimate: the mean over the MC samples (sequence-level samplers)."""
        return self.logp.mean(dim=1)


class MetricSums:
    """Averages per-piece metrics over an update; keys ending in `_max` keep the maximum."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, metrics: dict[str, Tensor | float]) -> None:
        for k, v in metrics.items():
            v = float(v)
            self.sums[k] = max(self.sums.get(k, -math.inf), v) if k.endswith("_max") else self.sums[k] + v
            self.counts[k] += 1

    def result(self) -> dict[str, float]:
        return {k: (v if k.endswith("_max") else v / self.counts[k]) for k, v in self.sums.items()}


class DeepSpeedLearner:
    """Holds the policy engine, the reference policy, the objective and its state."""

    def __init__(
        self,
        policy: nn.Module,
        sampler: GaussianStepSampler | MaskedDiffusionSampler,
        objective_cfg: ObjectiveSettings,
        learner_cfg: LearnerConfig,
        seed: int = 0,
        reward_fn: DifferentiableReward | None = None,
    ):
        import deepspeed

        self.sampler = sampler
        self.cfg = learner_cfg
        self.objective = build_objective(objective_cfg)
        self.reward_fn = reward_fn
        self.train_steps = sampler.train_steps(objective_cfg.train_min_std)
        if isinstance(self.objective, RewardBackpropObjective):
            if reward_fn is None:
                raise ValueError(f"objective {objective_cfg.name!r} back-propagates a reward: the learner needs "
                                 "a differentiable reward_fn")
            k = self.objective.cfg.backprop_steps
            if not 1 <= k <= len(sampler.timesteps):
                raise ValueError(f"objective.backprop_steps={k} must be in [1, {len(sampler.timesteps)}]")
            self.steps_per_sample = 1
        elif sampler.sequence_level:
            if self.objective.needs_old_mean:
                raise ValueError(f"objective {objective_cfg.name!r} needs Gaussian step means: it does not apply to "
                                 f"sampler.kind={sampler.cfg.kind!r}")
            self.steps_per_sample = len(self.train_steps)  # every MC sample of every sequence
        else:
            self.steps_per_sample = max(1, round(self.objective.cfg.timestep_fraction * len(self.train_steps)))
        balanced = learner_cfg.balanced
        self.network = getattr(policy, "net", policy)  # a Policy's network (module names as the model has them)
        if balanced.module_precision:
            apply_module_precision(self.network, balanced.module_precision)
        if balanced.activation_checkpointing:
            enable_activation_checkpointing(self.network)
        self.reference = make_reference(policy)  # a frozen copy, or (LoRA) the live network with adapters swapped
        self.advantage_clipper = (RollingQuantileClipper(balanced.quantile, balanced.quantile_window)
                                  if balanced.advantage_quantile_clip else None)
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend=communication_backend(learner_cfg.backend))
        self.rank, self.world_size = world()
        if self.world_size != learner_cfg.ranks:
            raise ValueError(f"learner.ranks={learner_cfg.ranks} but this process group has {self.world_size} "
                             "rank(s) (WORLD_SIZE)")
        params = [p for p in policy.parameters() if p.requires_grad]
        optimizer = None
        if balanced.dual_momentum:
            optimizer = DualMomentum(params, lr=learner_cfg.lr, short_horizon=balanced.short_horizon,
                                     long_horizon=balanced.long_horizon, beta2=learner_cfg.betas[1],
                                     weight_decay=learner_cfg.weight_decay)
        self.engine, _, _, _ = deepspeed.initialize(model=policy, model_parameters=params, optimizer=optimizer,
                                                    config=deepspeed_config(learner_cfg))
        self.device = self.engine.device  # the accelerator DeepSpeed placed the policy on (cpu under gloo)
        self.reference.to(self.device)
        self.adapters_only = bool(getattr(policy, "adapters_only", False))
        self.generator = torch.Generator().manual_seed(seed + self.rank)  # rank 0 draws as a 1-rank learner
        self.updates = 0
        self._pre_clip_norm: float | None = None
        self._module_scales: dict[str, float] = {}

    @property
    def policy(self) -> nn.Module:
        return self.engine.module

    # ------------------------------------------------------------------ reference (LearnerHooks)
    @torch.no_grad()
    def reset_reference(self) -> None:
        """Hard-copy the current policy's trained tensors (whole network, or adapters) into the reference."""
        with self.gathered():
            load_trainable_state(self.reference, trainable_state(self.policy))

    @torch.no_grad()
    def ema_reference(self, decay: float) -> None:
        """ref <- decay * ref + (1 - decay) * policy (floating-point trained tensors)."""
        with self.gathered():
            current = trainable_state(self.policy)
            for k, v in trainable_state(self.reference).items():
                if v.is_floating_point():
                    v.mul_(decay).add_(current[k].to(device=v.device, dtype=v.dtype), alpha=1 - decay)

    def gathered(self) -> contextlib.AbstractContextManager:
        """Under ZeRO-3 each rank holds a shard of every parameter: this context gathers the full tensors (a
        collective: every rank must enter it); a no-op for stages 0-2."""
        if self.cfg.zero_stage != 3:
            return contextlib.nullcontext()
        import deepspeed

        return deepspeed.zero.GatheredParameters(list(self.policy.parameters()), modifier_rank=None)

    # ------------------------------------------------------------------ the update
    @torch.no_grad()
    def _recompute_old(self, micro: list[RolloutBatch]) -> tuple[list[OldPolicy], dict[str, float]]:
        """Old log-probs at every trained step, micro-batched as the update is; plus the KL monitor."""
        steps = self.train_steps
        keep_mean = self.objective.needs_old_mean
        sequence = self.sequence_level
        out, diffs, kls, weights = [], [], [], []
        for mb in micro:
            lp = torch.zeros_like(mb.old_logp)
            mean = torch.zeros_like(mb.traj[:, 1:]) if keep_mean else None
            for s in steps.tolist():
                step = self.sampler.log_prob(self.engine, mb, s)
                lp[:, s] = step.logp
                if mean is not None:
                    mean[:, s] = step.mean
            old = OldPolicy(lp, mean)
            if sequence:
                old.ref_logp = torch.stack([self.sampler.log_prob(self.reference, mb, s).logp
                                            for s in steps.tolist()], dim=1).mean(dim=1)
            if isinstance(self.objective, RewardBackpropObjective):
                first = len(self.sampler.timesteps) - self.objective.cfg.backprop_steps
                old.noise = [self.sampler.recorded_noise(self.engine, mb, k)
                             for k in range(first, len(self.sampler.timesteps))]
            lagged = staleness(mb, self.updates) > 0
            current = ~lagged
            if current.any():  # the recompute alarm is about samples from the current policy
                diffs.append((lp[:, steps] - mb.old_logp[:, steps])[current.to(lp.device)].abs().max())
            if lagged.any():  # mb.old_logp is the behaviour policy's: kept beside the recomputed proximal one
                cap = self.cfg.behaviour_weight_cap
                if sequence:
                    old.behaviour_weight = behaviour_weight(old.sequence_logp, mb.old_logp.mean(dim=1), lagged, cap)
                    weights.append(old.behaviour_weight[lagged.to(lp.device)])
                else:
                    old.behaviour_weight = behaviour_weight(lp, mb.old_logp, lagged, cap)
                    weights.append(old.behaviour_weight[lagged.to(lp.device)][:, steps].flatten())
            out.append(old)
            if sequence:  # KL(pi_theta || pi_ref) monitor: k3 of the sequence estimates
                kls.append(self.sampler.kl(StepLogProb(old.sequence_logp, None, None),
                                           StepLogProb(old.ref_logp, None, None)))
                continue
            # KL(pi_theta || pi_ref) monitor: one random trained step per sample
            s = steps[torch.randint(len(steps), (len(mb),), generator=self.generator)]
            kls.append(self._kl_to_reference(mb, s))
        absdiff = float(torch.stack(diffs).max()) if diffs else 0.0
        if absdiff > self.cfg.logp_alarm:
            log.warning("recomputed old log-probs differ from the rollout's by %.2e (> %.0e): policy "
                        "weights out of sync or numerics drift", absdiff, self.cfg.logp_alarm)
        metrics = {"policy/rollout_logp_absdiff_max": absdiff,
                   "policy/rollout_logp_alarm": float(absdiff > self.cfg.logp_alarm),
                   "policy/kl_ref_monitor": float(torch.cat(kls).mean())}
        if self.cfg.max_staleness > 0:
            w = torch.cat(weights) if weights else torch.ones(1)
            metrics.update({"async/behaviour_weight_mean": float(w.mean()), "async/behaviour_weight_max": float(w.max()),
                            "async/behaviour_weight_min": float(w.min()),
                            "async/behaviour_weight_capped": float((w >= self.cfg.behaviour_weight_cap).double().mean())})
        return out, metrics

    @property
    def sequence_level(self) -> bool:
        """The sampler's steps are MC samples of one sequence-level likelihood (masked diffusion)."""
        return self.sampler.sequence_level

    def _kl_to_reference(self, mb: RolloutBatch, step: Tensor, new: StepLogProb | None = None) -> Tensor:
        """Per-sample KL of the policy step to the reference step (grad flows through `new`)."""
        if new is None:
            new = self.sampler.log_prob(self.engine, mb, step)
        with torch.no_grad():
            ref = self.sampler.log_prob(self.reference, mb, step)
        return self.sampler.kl(new, ref)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL update over the whole batch; returns scalar metrics."""
        finite = batch.train_reward().isfinite()
        skipped = int((~finite).sum())
        if skipped:
            log.warning("skipping %d samples with non-finite rewards", skipped)
            batch = batch.index(torch.nonzero(finite).flatten())
        if len(batch) == 0:
            raise ValueError("no sample in the batch has a finite reward")
        lag = staleness(batch, self.updates)
        check_staleness(lag, self.cfg.max_staleness)
        batch, metrics = self.objective.prepare_batch(batch)  # on the whole batch, identically on every rank
        if self.cfg.max_staleness > 0:
            metrics["async/staleness_max"] = float(lag.max())
        if self.advantage_clipper is not None and batch.advantages is not None:
            batch = batch.replace(advantages=self.advantage_clipper(batch.advantages))
            metrics["balanced/adv_clip_q"] = float(self.advantage_clipper.last_q)
        shares = group_shares(batch, self.world_size)  # then each rank trains on its own prompt groups
        mine = batch.index(shares[self.rank])
        perm = torch.randperm(len(mine), generator=self.generator)
        count = micro_batch_count([len(s) for s in shares], self.cfg.micro_batch_size)
        micro = [mb.to(device=self.device) for mb in split_into(mine.index(perm), count, self.cfg.micro_batch_size)]
        olds, recompute_metrics = self._recompute_old(micro)
        metrics.update(recompute_metrics)
        k = self.cfg.micro_per_optim_step
        groups = [list(range(i, min(i + k, len(micro)))) for i in range(0, len(micro), k)]
        sums = MetricSums()
        grad_norms: list[float] = []
        self.engine.train()
        for _ in range(self.cfg.inner_epochs):
            for group in groups:
                if isinstance(self.objective, RewardBackpropObjective):
                    self._reward_backprop_step([micro[i] for i in group], [olds[i] for i in group], sums)
                else:
                    self._policy_gradient_step([micro[i] for i in group], [olds[i] for i in group], sums)
                norm = self.engine.get_global_grad_norm()  # set by ZeRO optimisers; None for stage 0
                norm = self._pre_clip_norm if norm is None else float(norm)
                if norm is not None and math.isfinite(norm):
                    grad_norms.append(norm)
        self.updates += 1
        metrics.update(sums.result())
        metrics = reduce_metrics(metrics)  # every rank's objective state then moves alike
        metrics.update(self.objective.after_update(self, metrics))
        metrics.update({
            "policy/grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
            "policy/adv_abs_mean": float(batch.advantages.abs().mean()) if batch.advantages is not None else 0.0,
            "policy/optimizer_steps": float(len(groups) * self.cfg.inner_epochs),
            "reward/nonfinite_skipped": float(skipped),
            "policy/samples": float(len(batch)),  # trained on, over all ranks (counted: none lost or duplicated)
            "policy/lr": float(self.engine.get_lr()[0]),
            "sync/bytes": float(state_bytes(trainable_state(self.policy))),
        })
        if self._module_scales:
            metrics["balanced/module_scale_max"] = max(self._module_scales.values())
            metrics["balanced/module_scale_min"] = min(self._module_scales.values())
        return metrics

    def _step_extent(self, local: int) -> tuple[int, int]:
        """(samples in this optimisation step on all ranks, samples of it on lower ranks)."""
        if self.world_size == 1:
            return local, 0
        counts = all_gather(local)
        return sum(counts), sum(counts[: self.rank])

    def _backward(self, loss: Tensor, last: bool) -> None:
        """Back-propagate one piece; on the last piece of an optimisation step, step the optimiser.

        Pieces carry the whole step's normalisers (all ranks' terms); DeepSpeed's all-reduce averages the
        ranks' gradients, so each rank scales its loss by the world size: the step's gradient is the sum over
        every piece, as on one rank."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world_size if self.world_size > 1 else loss, scale_wrt_gas=False)
        if last:
            self._pre_clip_norm = self._grad_norm()
            if self.cfg.balanced.module_grad_scaling:  # after the accumulation boundary, before clip and step
                scales = scale_module_gradients(self.network, self.cfg.balanced.scaling_depth,
                                                self.cfg.balanced.scaling_eps)
                self._module_scales = scales
            self.engine.step()

    def _policy_gradient_step(self, group: list[RolloutBatch], olds: list[OldPolicy], sums: MetricSums) -> None:
        """One optimisation step of a per-step likelihood-ratio objective over `group`'s micro-batches."""
        assert isinstance(self.objective, PolicyGradientObjective)
        if self.sequence_level and self.sampler.independent_masks:  # the new policy's masks, fresh per optimiser step
            group = [self.sampler.with_fresh_masks(mb, self.generator) for mb in group]
        if self.sequence_level and self.objective.ratio_scope == "sequence":
            return self._sequence_step(group, olds, sums)
        steps, n = self.train_steps, self.steps_per_sample
        chosen = [torch.stack([steps[torch.randperm(len(steps), generator=self.generator)][:n] for _ in range(len(mb))])
                  for mb in group]
        total, before = self._step_extent(sum(len(mb) for mb in group))
        n_terms = total * n
        stats = self._prepare(group, olds, chosen, before) if self.objective.needs_prepare else {}
        offsets = [before + sum(len(mb) for mb in group[:i]) for i in range(len(group))]
        pieces = [(i, j) for i in range(len(group)) for j in range(n)]
        for p, (i, j) in enumerate(pieces):
            inputs = self._step_inputs(group[i], olds[i], chosen[i][:, j], n_terms)
            inputs.rows = offsets[i] + torch.arange(len(group[i]))
            loss, m = self.objective.loss(inputs, stats)
            self._backward(loss, last=p == len(pieces) - 1)
            sums.add(m)

    def _step_inputs(self, mb: RolloutBatch, old: OldPolicy, step: Tensor, n_terms: int) -> StepInputs:
        rows = torch.arange(len(mb))
        new = self.sampler.log_prob(self.engine, mb, step)
        kl = self._kl_to_reference(mb, step, new) if self.objective.needs_reference else None
        dtype = new.logp.dtype
        return StepInputs(
            new_logp=new.logp, old_logp=old.logp[rows, step], advantages=old.weighted(mb.advantages, rows, step), step=step,
            std=self.sampler.std[step].to(dtype) if new.std is None else new.std, dt=self.sampler.dt[step].to(dtype),
            n_terms=n_terms, new_mean=new.mean,
            old_mean=None if old.mean is None else old.mean[rows, step], kl_ref=kl, micro=mb,
            reduce=self.sampler.reduce)

    @torch.no_grad()
    def _prepare(self, group: list[RolloutBatch], olds: list[OldPolicy], chosen: list[Tensor],
                 rows_before: int = 0) -> dict[str, Tensor]:
        """The objective's no-grad pass over every term of the optimisation step (every rank's), at the current
        weights."""
        pieces, offset = [], 0
        for mb, old, ch in zip(group, olds, chosen):
            rows = torch.arange(len(mb))
            for j in range(ch.shape[1]):
                s = ch[:, j]
                new = self.sampler.log_prob(self.engine, mb, s)
                std = self.sampler.std[s].to(new.logp.dtype) if new.std is None else new.std
                pieces.append(PreparePiece(
                    new_logp=new.logp, old_logp=old.logp[rows, s], advantages=old.weighted(mb.advantages, rows, s),
                    step=s, std=std,
                    group=mb.group,
                    dt=self.sampler.dt[s].to(new.logp.dtype), rows=offset + rows, new_mean=new.mean,
                    old_mean=None if old.mean is None else old.mean[rows, s]))
            offset += len(mb)
        return self._device_stats(self.objective.prepare(gather_pieces(pieces, rows_before)))

    def _device_stats(self, stats: dict[str, Tensor]) -> dict[str, Tensor]:
        """Statistics computed over gathered (CPU) pieces, back on the engine's device."""
        if self.world_size == 1:
            return stats
        return {k: v.to(self.device) for k, v in stats.items()}

    def _sequence_step(self, group: list[RolloutBatch], olds: list[OldPolicy], sums: MetricSums) -> None:
        """One optimisation step of a sequence-level objective f(log rho) over MC-estimated likelihoods.

        log pi(y) is estimated by ell_bar = (1/n) sum_j ell_j over the n MC mask samples. A no-grad pass
        computes ell_bar at the current weights; then each MC sample j is back-propagated on its own with

            new_logp_j = sg(ell_bar) + (ell_j - sg(ell_j)) / n       value ell_bar, gradient grad(ell_j) / n

        so the objective is evaluated at the exact sequence ratio and the pieces' gradients sum to
        f'(ell_bar) grad(ell_bar): the exact objective's gradient in n backward passes, with memory of one
        (the two-pass form; BGPO's bound is the per-term alternative). `n_terms` counts sequences.
        """
        n = len(self.train_steps)
        dtype = olds[0].logp.dtype
        with torch.no_grad():
            passes = [[self.sampler.log_prob(self.engine, mb, j) for j in range(n)] for mb in group]
        current = [torch.stack([p.logp for p in mc], 1).mean(1) for mc in passes]
        total, before = self._step_extent(sum(len(mb) for mb in group))
        offsets = [before + sum(len(mb) for mb in group[:i]) for i in range(len(group))]
        stats: dict[str, Tensor] = {}
        if self.objective.needs_prepare:
            stats = self._device_stats(self.objective.prepare(gather_pieces([
                PreparePiece(new_logp=cur, old_logp=old.sequence_logp, advantages=old.weighted(mb.advantages),
                             step=torch.zeros(len(mb), dtype=torch.long), std=torch.ones(len(mb), dtype=dtype),
                             dt=torch.ones(len(mb), dtype=dtype), rows=off + torch.arange(len(mb)), group=mb.group,
                             tokens=[p.tokens for p in mc])
                for mb, old, cur, off, mc in zip(group, olds, current, [o - before for o in offsets], passes)],
                before)))
        n_terms = total
        pieces = [(i, j) for i in range(len(group)) for j in range(n)]
        for p, (i, j) in enumerate(pieces):
            mb, old = group[i], olds[i]
            new = self.sampler.log_prob(self.engine, mb, j)
            linear = current[i] + (new.logp - new.logp.detach()) / n
            seq_new = StepLogProb(linear, None, None, tokens=new.tokens)
            kl = None
            if self.objective.needs_reference:
                kl = self.sampler.kl(seq_new, StepLogProb(old.ref_logp, None, None))
            ones = torch.ones(len(mb), dtype=dtype)
            inputs = StepInputs(new_logp=linear, old_logp=old.sequence_logp, advantages=old.weighted(mb.advantages),
                                step=torch.full((len(mb),), j, dtype=torch.long), std=ones, dt=ones, n_terms=n_terms,
                                rows=offsets[i] + torch.arange(len(mb)), kl_ref=kl, micro=mb,
                                reduce=self.sampler.reduce, tokens=new.tokens)
            loss, m = self.objective.loss(inputs, stats)
            self._backward(loss, last=p == len(pieces) - 1)
            sums.add(m)

    def _reward_backprop_step(self, group: list[RolloutBatch], olds: list[OldPolicy], sums: MetricSums) -> None:
        """One optimisation step of reward back-propagation through the last K steps (DRaFT-K).

        surrogate = -sum_i <G_i, x0_i> / n with G = regulate(dr/dx0): its gradient is -grad mean_i r(x0_i)
        when G is not rescaled.
        """
        assert isinstance(self.objective, RewardBackpropObjective) and self.reward_fn is not None
        first = len(self.sampler.timesteps) - self.objective.cfg.backprop_steps
        n, _ = self._step_extent(sum(len(mb) for mb in group))
        for p, (mb, old) in enumerate(zip(group, olds)):
            x0 = self.sampler.denoise_from(self.engine, mb, first, old.noise or [])
            leaf = x0.detach().requires_grad_(True)
            reward = self.reward_fn(leaf, mb.cond)
            (grad,) = torch.autograd.grad(reward.sum(), leaf)
            flat, m = self.objective.regulate(grad.flatten(1))
            surrogate = -(flat.view_as(x0).detach() * x0).sum() / n
            self._backward(surrogate, last=p == len(group) - 1)
            m["reward/backprop_mean"] = reward.detach().mean()
            sums.add(m)

    def _grad_norm(self) -> float | None:
        """Global L2 norm of the accumulated (unclipped) gradients, where they live on the params."""
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else None

    # ------------------------------------------------------------------ weights and checkpoints
    def weights(self) -> dict[str, Tensor]:
        """A CPU copy of the trained tensors (the whole network, or only its LoRA adapters), to publish to
        rollout workers and to checkpoint. Under ZeRO-3 a collective: every rank must call it."""
        with self.gathered():
            return {k: v.detach().to("cpu", copy=True) for k, v in trainable_state(self.policy).items()}

    def save(self, directory: Path) -> None:
        """Engine (trained tensors + optimiser; a LoRA policy's frozen base is not written; ZeRO: every rank its
        shards), and from rank 0 the policy, reference and objective state; each rank its own RNG.
        Every rank must call it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(directory), tag="engine", save_latest=False,
                                    exclude_frozen_parameters=self.adapters_only)
        weights = self.weights()
        if self.rank > 0:
            torch.save({"generator": self.generator.get_state()}, directory / f"learner_state_rank{self.rank}.pt")
            return
        save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / "policy.safetensors"))
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in trainable_state(self.reference).items()},
                  str(directory / "reference.safetensors"))  # copies: tied weights share storage
        torch.save({"generator": self.generator.get_state(), "updates": self.updates,
                    "objective": self.objective.name, "objective_state": self.objective.state_dict(),
                    "advantage_clipper": (None if self.advantage_clipper is None
                                          else self.advantage_clipper.state_dict()),
                    "world_size": self.world_size},
                   directory / "learner_state.pt")

    def load(self, directory: Path) -> None:
        directory = Path(directory)
        state = torch.load(directory / "learner_state.pt", weights_only=True)
        if state["objective"] != self.objective.name:
            raise ValueError(f"checkpoint {directory} was written by objective {state['objective']!r}, "
                             f"not {self.objective.name!r}")
        saved_world = int(state.get("world_size", 1))
        if saved_world != self.world_size:
            raise ValueError(f"checkpoint {directory} was written by {saved_world} learner rank(s), not "
                             f"learner.ranks={self.world_size}: resume with the same number of ranks")
        self.engine.load_checkpoint(str(directory), tag="engine", load_module_strict=not self.adapters_only)
        load_trainable_state(self.reference, load_file(str(directory / "reference.safetensors")))
        own = state if self.rank == 0 else torch.load(directory / f"learner_state_rank{self.rank}.pt",
                                                      weights_only=True)
        self.generator.set_state(own["generator"])
        self.updates = int(state["updates"])
        self.objective.load_state_dict(state["objective_state"])
        if self.advantage_clipper is not None and state.get("advantage_clipper") is not None:
            self.advantage_clipper.load_state_dict(state["advantage_clipper"])
