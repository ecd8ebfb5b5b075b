"""The DeepSpeed learner: recompute old log-probs, apply the objective, step the optimiser.

It is given its parts, built by trainer/builders.py: the policy (prepared to train), a `Sampler`, the objective,
the frozen reference and the optimiser choice (DualMomentum, or DeepSpeed's AdamW from the config).

One `update(batch)`:
 1. `objective.prepare_batch` on the whole batch (advantages, gates, per-sample weights);
 2. a fixed shuffle into micro-batches; a no-grad pre-pass (trainer/recompute.py) recomputes old_logp (and,
    where the objective asks, the old step means) at every trained step with the update's own micro-batching
    (float32 numerics depend on batch shape and threads), logs the gap to the rollout's values
    (`policy/rollout_logp_absdiff_max`), the KL to the reference, and weighs lagged samples; between checks
    (`learner.old_logp: auto`) current samples keep the rollout's log-probs while they matched the recompute;
 3. `inner_epochs` passes over optimisation steps of `optim_batch_size` samples (several micro-batches). Per
    optimisation step a term producer (trainer/terms.py: per-step, sequence or reward back-propagation, picked
    once by objective and sampler) draws the step's randomness; the objective may run a no-grad `prepare` over
    all its terms (whole-step normalisers, every rank's pieces gathered), then every piece is back-propagated
    (in parts when it does not fit in memory, the same gradient: trainer/memory_split.py) and the optimiser steps
    once;
 4. `objective.after_update` (reference reset / EMA through `reset_reference` / `ema_reference`).
"""
from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from collections import defaultdict
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.compile import compile_seconds, is_compiled
from steadyrl.rollout.policy import load_trainable_state, state_bytes, trainable_state
from steadyrl.rollout.sampler import Sampler
from steadyrl.trainer.balanced_gradient import RollingQuantileClipper, scale_module_gradients
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.context import DifferentiableReward, UpdateContext
from steadyrl.trainer.controls import UpdateControls
from steadyrl.trainer.reward_stats import weighting_panel
from steadyrl.trainer.deepspeed_config import (check_fused_adam, communication_backend, deepspeed_config,
                                               fused_adam_build_env)
from steadyrl.trainer.distributed import (gather_pieces, group_shares, micro_batch_count, reduce_metrics, split_into,
                                          world)
from steadyrl.trainer.health import (advantage_panel, clip_group_gradients, drop_nonfinite_advantages,
                                     group_grad_norms, mean_group_norms, reward_panel, zero_std_group_fraction)
from steadyrl.trainer.kl_schedule import kl_factor
from steadyrl.trainer.linear_schedule import linear_value
from steadyrl.trainer.lr_schedule import lr_factor
from steadyrl.trainer.memory_split import PieceSplitter
from steadyrl.trainer.objectives import Objective, UpdateSchedule
from steadyrl.trainer.off_policy import check_staleness, staleness
from steadyrl.trainer.recompute import OldPolicy, RolloutLogpTrust, recompute_old
from steadyrl.trainer.terms import TermProducer, term_producer

log = logging.getLogger(__name__)


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
        sampler: Sampler,
        objective: Objective,
        learner_cfg: LearnerConfig,
        reference: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        seed: int = 0,
        reward_fn: DifferentiableReward | None = None,
    ):
        """`policy` prepared to train and `reference` its frozen reference (trainer/builders.py); `optimizer`
        a client optimiser over the policy's trained parameters, or None: DeepSpeed's AdamW from the config.
        Builds the engine (joining the process group first if needed)."""
        import deepspeed

        self.sampler = sampler
        self.cfg = learner_cfg
        self.objective = objective
        self.reward_fn = reward_fn
        self.train_steps = sampler.train_steps(objective.cfg.train_min_std)
        self.terms: type[TermProducer] = term_producer(objective, sampler, reward_fn)  # the update path
        balanced = learner_cfg.balanced
        self.network = getattr(policy, "net", policy)  # a Policy's network (module names as the model has them)
        self.reference = reference
        self.advantage_clipper = (RollingQuantileClipper(balanced.quantile, balanced.quantile_window)
                                  if balanced.advantage_quantile_clip else None)
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend=communication_backend(learner_cfg.backend))
        self.rank, self.world_size = world()
        if self.world_size != learner_cfg.ranks:
            raise ValueError(f"learner.ranks={learner_cfg.ranks} but this process group has {self.world_size} "
                             "rank(s) (WORLD_SIZE)")
        check_fused_adam(learner_cfg)
        if learner_cfg.fused_adam:  # DeepSpeed compiles FusedAdam in this process, reading TORCH_CUDA_ARCH_LIST
            os.environ.update(fused_adam_build_env(os.environ))
        params = [p for p in policy.parameters() if p.requires_grad]
        self.engine, _, _, _ = deepspeed.initialize(
            model=policy, model_parameters=params, optimizer=optimizer,
            config=deepspeed_config(learner_cfg, client_optimizer=optimizer is not None))
        self.device = self.engine.device  # the accelerator DeepSpeed placed the policy on (cpu under gloo)
        self.reference.to(self.device)
        self.adapters_only = bool(getattr(policy, "adapters_only", False))
        self.generator = torch.Generator().manual_seed(seed + self.rank)  # rank 0 draws as a 1-rank learner
        self.updates = 0
        self._pre_clip_norm: float | None = None
        self._group_norms: list[dict[str, float]] = []  # per optimiser step of the current update (health panel)
        self._groups_clipped = 0  # module gradients clipped by learner.group_grad_clip in the current update
        self._steps_skipped = 0  # optimiser steps of the current update skipped for a non-finite gradient
        self._module_scales: dict[str, float] = {}
        frozen = [reference] + ([reward_fn] if isinstance(reward_fn, nn.Module) else [])
        self.splitter = PieceSplitter(learner_cfg.activation_memory_cap_mb, [policy, *frozen],  # out-of-memory splits
                                      collective_backward=self.world_size > 1 and learner_cfg.zero_stage >= 2)
        self.last_batch: RolloutBatch | None = None
        self.logp_trust = RolloutLogpTrust(learner_cfg.old_logp, learner_cfg.logp_check_every,
                                           learner_cfg.logp_trust_tol)

    @property
    def policy(self) -> nn.Module:
        return self.engine.module

    @property
    def sequence_level(self) -> bool:
        """The sampler's steps are MC samples of one sequence-level likelihood (masked diffusion)."""
        return self.sampler.sequence_level

    def context(self) -> UpdateContext:
        """What the recompute pre-pass and the term producers read of this learner."""
        return UpdateContext(sampler=self.sampler, policy=self.engine, reference=self.reference,
                             objective=self.objective, train_steps=self.batch_train_steps(), generator=self.generator,
                             reward_fn=self.reward_fn)

    def batch_train_steps(self) -> Tensor:
        """The trained steps of the current batch: the sampler's, within the batch's `trainable` steps (an SDE
        window's steps, rollout/sde_window.py; every stochastic step otherwise). The objective's
        `timestep_fraction` then draws its share of these."""
        if self.last_batch is None or self.sequence_level:
            return self.train_steps
        steps = self.train_steps[self.last_batch.trainable.cpu().bool()[self.train_steps]]
        if len(steps) == 0:
            raise ValueError("the batch's SDE window (sampler.sde_window) has no step with std >= "
                             "objective.train_min_std: nothing to train")
        return steps

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
    def update(self, batch: RolloutBatch, controls: UpdateControls | None = None) -> dict[str, float]:
        """One RL update over the whole batch (`controls`: the controller's factors on lr and KL weight); returns
        scalar metrics. The steps of the module docstring, each a method below."""
        controls = controls or UpdateControls()
        self.last_batch = batch  # kept until the next update: `save_batch` writes it when the controller asks
        batch, skipped = self._finite_rewards(batch)
        self._set_schedules(controls)
        lag = staleness(batch, self.updates)
        check_staleness(lag, self.cfg.max_staleness)
        batch, metrics = self._prepare_batch(batch)  # 1. advantages, gates, weights: identically on every rank
        if self.cfg.max_staleness > 0:
            metrics["async/staleness_max"] = float(lag.max())
        micro = self._micro_batches(batch)  # this rank's prompt groups, shuffled, split
        t0, compiled_s = time.perf_counter(), compile_seconds()
        olds, recompute_metrics = self._recompute_old(micro)  # 2. the no-grad pre-pass
        metrics.update(recompute_metrics)
        metrics["timing_s/old_policy"] = time.perf_counter() - t0
        sums, grad_norms, optimiser_steps = self._optimise(micro, olds)  # 3. inner epochs of optimisation steps
        if is_compiled(self.policy):  # seconds of this update spent compiling its graphs (first shapes)
            metrics["timing_s/update_compile"] = compile_seconds() - compiled_s
        self.updates += 1
        metrics.update(sums.result())
        metrics.update(self.splitter.metrics())  # memory/splits, memory/piece_size_min (trainer/memory_split.py)
        metrics = reduce_metrics(metrics)  # every rank's objective state then moves alike
        self.logp_trust.observe(metrics)
        metrics.update(self.objective.after_update(self, metrics))  # 4. reference reset / EMA
        metrics.update(self._update_panel(batch, grad_norms, optimiser_steps, skipped, controls))
        return metrics

    def _finite_rewards(self, batch: RolloutBatch) -> tuple[RolloutBatch, int]:
        """The batch without its samples of non-finite reward (skipped and counted, never trained on)."""
        finite = batch.train_reward().isfinite()
        skipped = int((~finite).sum())
        if skipped:
            log.warning("skipping %d samples with non-finite rewards", skipped)
            batch = batch.index(torch.nonzero(finite).flatten())
        if len(batch) == 0:
            raise ValueError("no sample in the batch has a finite reward")
        return batch, skipped

    def _prepare_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """`objective.prepare_batch` on the whole batch, samples of non-finite advantage dropped, the reward and
        advantage panels, and the balanced advantage clip where it is on."""
        batch, metrics = self.objective.prepare_batch(batch)
        batch, nonfinite_adv = drop_nonfinite_advantages(batch)
        if nonfinite_adv:
            log.warning("dropping %d samples with non-finite advantages", nonfinite_adv)
        if len(batch) == 0:
            raise ValueError("no sample in the batch has a finite advantage")
        metrics.update({**reward_panel(batch), **weighting_panel(batch), **advantage_panel(batch.advantages),
                        "health/zero_std_group_frac": zero_std_group_fraction(batch.train_reward(), batch.group),
                        "health/nonfinite_adv_dropped": float(nonfinite_adv)})
        if self.advantage_clipper is not None and batch.advantages is not None:
            batch = batch.replace(advantages=self.advantage_clipper(batch.advantages))
            metrics["balanced/adv_clip_q"] = float(self.advantage_clipper.last_q)
        return batch, metrics

    def _micro_batches(self, batch: RolloutBatch) -> list[RolloutBatch]:
        """This rank's prompt groups (`group_shares`), in a fixed shuffle, split into micro-batches on its device."""
        shares = group_shares(batch, self.world_size)
        mine = batch.index(shares[self.rank])
        perm = torch.randperm(len(mine), generator=self.generator)
        count = micro_batch_count([len(s) for s in shares], self.cfg.micro_batch_size)
        return [mb.to(device=self.device) for mb in split_into(mine.index(perm), count, self.cfg.micro_batch_size)]

    def _optimise(self, micro: list[RolloutBatch], olds: list[OldPolicy]) -> tuple[MetricSums, list[float], int]:
        """`inner_epochs` passes over optimisation steps of `micro_per_optim_step` micro-batches: the pieces'
        metric sums, each step's gradient norm, the optimiser steps taken."""
        k = self.cfg.micro_per_optim_step
        groups = [list(range(i, min(i + k, len(micro)))) for i in range(0, len(micro), k)]
        sums = MetricSums()
        grad_norms: list[float] = []
        self._group_norms, self._groups_clipped, self._steps_skipped = [], 0, 0
        self.splitter.start_update()
        self.engine.train()
        for _ in range(self.cfg.inner_epochs):
            for group in groups:
                self._optimisation_step([micro[i] for i in group], [olds[i] for i in group], sums)
                norm = self.engine.get_global_grad_norm()  # set by ZeRO optimisers; None for stage 0
                norm = self._pre_clip_norm if norm is None else float(norm)
                if norm is not None and math.isfinite(norm):
                    grad_norms.append(norm)
        return sums, grad_norms, len(groups) * self.cfg.inner_epochs

    def _update_panel(self, batch: RolloutBatch, grad_norms: list[float], optimiser_steps: int, skipped: int,
                      controls: UpdateControls) -> dict[str, float]:
        """The update's own figures: gradient norms and guards, samples, lr and KL weight, bytes to sync."""
        panel = {
            "policy/grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
            **mean_group_norms(self._group_norms),
            "health/groups_clipped": float(self._groups_clipped),
            "health/nonfinite_grad_steps_skipped": float(self._steps_skipped),
            "policy/adv_abs_mean": float(batch.advantages.abs().mean()) if batch.advantages is not None else 0.0,
            "policy/optimizer_steps": float(optimiser_steps),
            "reward/nonfinite_skipped": float(skipped),
            "policy/samples": float(len(batch)),  # trained on, over all ranks (counted: none lost or duplicated)
            "policy/lr": float(self.engine.get_lr()[0]),
            "policy/kl_weight": self.objective.kl_weight,
            "policy/lr_scale": controls.lr_scale,
            "health/kl_boost": controls.kl_boost,
            "sync/bytes": float(state_bytes(trainable_state(self.policy))),
        }
        if self._module_scales:
            panel["balanced/module_scale_max"] = max(self._module_scales.values())
            panel["balanced/module_scale_min"] = min(self._module_scales.values())
        return panel

    def _set_schedules(self, controls: UpdateControls) -> None:
        """This update's learning rate and KL weight from their schedules (trainer/lr_schedule.py,
        trainer/kl_schedule.py), the update count and the controller's factors (trainer/controls.py)."""
        lr = self.cfg.lr * lr_factor(self.cfg.lr_schedule, self.updates) * controls.lr_scale
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr
        kl_scale = kl_factor(self.cfg.kl_schedule, self.updates) * controls.kl_boost
        self.objective.begin_update(UpdateSchedule(self.updates, kl_scale))

    def _recompute_old(self, micro: list[RolloutBatch]) -> tuple[list[OldPolicy], dict[str, float]]:
        """The no-grad pre-pass over the update's micro-batches (trainer/recompute.py) and its metrics."""
        return recompute_old(self.context(), micro, self.updates, self.cfg,
                             recompute=self.logp_trust.recompute_due(self.updates))

    def _optimisation_step(self, group: list[RolloutBatch], olds: list[OldPolicy], sums: MetricSums) -> None:
        """One optimiser step over `group`'s micro-batches: the update path's terms, the objective's no-grad
        `prepare` where it asks, then one backward per piece (the optimiser steps after the last)."""
        terms = self.terms(self.context(), group, olds)  # draws the step's randomness
        stats = self._prepare(terms) if self.objective.needs_prepare else {}
        keys = terms.keys()
        for p, key in enumerate(keys):
            self._piece(terms, key, stats, sums, last_piece=p == len(keys) - 1)

    def _piece(self, terms: TermProducer, key: tuple[int, int], stats: dict[str, Tensor], sums: MetricSums,
               last_piece: bool) -> None:
        """Back-propagate one piece (the objective's loss minus its entropy bonus), whole or in parts when it does
        not fit (trainer/memory_split.py); the optimiser steps after the last part of the step's last piece."""
        for m in self.splitter.run(lambda part: terms.piece(key, part), terms.piece_rows(key), self.objective, stats,
                                   lambda loss, last_part: self._backward(loss, last=last_piece and last_part)):
            sums.add(m)

    @torch.no_grad()
    def _prepare(self, terms: TermProducer) -> dict[str, Tensor]:
        """The objective's no-grad pass over every term of the optimisation step, every rank's, at the current
        weights; its statistics on the engine's device."""
        stats = self.objective.prepare(gather_pieces(terms.prepare_terms(), terms.rows_before))
        if self.world_size == 1:
            return stats
        return {k: v.to(self.device) for k, v in stats.items()}

    def _backward(self, loss: Tensor, last: bool) -> None:
        """Back-propagate one piece; on the last piece of an optimisation step, step the optimiser.

        Pieces carry the whole step's normalisers (all ranks' terms); DeepSpeed's all-reduce averages the
        ranks' gradients, so each rank scales its loss by the world size: the step's gradient is the sum over
        every piece, as on one rank."""
        self.engine.set_gradient_accumulation_boundary(last)
        self.engine.backward(loss * self.world_size if self.world_size > 1 else loss, scale_wrt_gas=False)
        if last:
            self.objective.step_done()
            self.objective.regulate_gradients(self.network)  # the objective's own (GRPO-Guard's per-block guard)
            self._pre_clip_norm = self._grad_norm()
            if self._pre_clip_norm is not None and not math.isfinite(self._pre_clip_norm):
                # a NaN or inf gradient would write NaN into every weight it reaches, and the rollouts would
                # sample from them: the step is skipped (as AMP's GradScaler skips an overflowing one) and counted;
                # the loss it came from stays in the metrics, where the collapse watch sees it. The norm is of the
                # all-reduced gradient, so every rank skips alike.
                self.engine.zero_grad()
                self._steps_skipped += 1
                log.warning("optimiser step skipped: the gradient's norm is %s", self._pre_clip_norm)
                return
            norms = group_grad_norms(self.network)
            self._group_norms.append(norms)
            if self.cfg.group_grad_clip is not None:  # per module, before DeepSpeed's global clip in step()
                self._groups_clipped += clip_group_gradients(self.network, self.cfg.group_grad_clip, norms)
            if self.cfg.balanced.module_grad_scaling:  # after the accumulation boundary, before clip and step
                strength = linear_value(self.cfg.balanced.scaling_strength, self.updates,
                                        "learner.balanced.scaling_strength")
                scales = scale_module_gradients(self.network, self.cfg.balanced.scaling_depth,
                                                self.cfg.balanced.scaling_eps, strength)
                self._module_scales = scales
            self.engine.step()

    def _grad_norm(self) -> float | None:
        """Global L2 norm of the accumulated (unclipped) gradients, where they live on the params."""
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def save_batch(self, directory: Path) -> None:
        """The last update's batch as it arrived (samples, conditions, groups and every reward model's scores) to
        `directory`/batch.safetensors, with the reward names in its metadata: what the controller keeps of a batch
        that raised an anomaly. Rank 0 writes; a learner without a batch yet writes nothing."""
        batch = self.last_batch
        if batch is None or self.rank > 0:
            return
        tensors = {name: getattr(batch, name) for name in ("cond", "group", "samples", "rewards", "uncertainty")
                   if getattr(batch, name) is not None}
        Path(directory).mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()},
                  str(Path(directory) / "batch.safetensors"),
                  metadata={"reward_names": ",".join(batch.reward_names), "reward_key": batch.reward_key or ""})

    # ------------------------------------------------------------------ weights and checkpoints
    def weights(self) -> dict[str, Tensor]:
        """A CPU copy of the trained tensors (the whole network, or only its LoRA adapters), to publish to
        rollout workers and to checkpoint. Under ZeRO-3 a collective: every rank must call it."""
        with self.gathered():
            return {k: v.detach().to("cpu", copy=True) for k, v in trainable_state(self.policy).items()}

    def sampling_weights(self) -> dict[str, Tensor]:
        """A CPU copy of what the rollout workers sample with: the objective's sampling policy where it keeps one
        (DiffusionNFT's old copy, `Objective.sampling_state`), else the trained tensors (`weights`). Keyed alike,
        so a worker loads either. Under ZeRO-3 a collective: every rank must call it."""
        with self.gathered():
            state = self.objective.sampling_state(self.policy)
            if state is None:
                state = trainable_state(self.policy)
            return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}

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
                    "world_size": self.world_size, "logp_trust": self.logp_trust.state_dict()},
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
        if "logp_trust" in state:  # checkpoints from before learner.old_logp recompute at their next update
            self.logp_trust.load_state_dict(state["logp_trust"])
        if self.advantage_clipper is not None and state.get("advantage_clipper") is not None:
            self.advantage_clipper.load_state_dict(state["advantage_clipper"])
