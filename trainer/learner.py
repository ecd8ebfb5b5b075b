"""The DeepSpeed learner: recompute old log-probs, apply the objective, step the optimiser.

One `update(batch)`:
 1. advantages from the objective (group-relative for GRPO);
 2. a fixed shuffle into micro-batches; a no-grad pre-pass recomputes old_logp at every trained
    step (stochastic and std >= objective.train_min_std) with the update's own micro-batching
    (float32 numerics depend on batch shape and threads) and logs the gap to the rollout's values
    (`policy/rollout_logp_absdiff_max`);
 3. `inner_epochs` passes; in each, every sample trains on a random `timestep_fraction` of the
    trained steps; gradients accumulate over those steps (DeepSpeed GAS) and the optimiser steps
    once per micro-batch.
"""
from __future__ import annotations

import copy
import json
import logging
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from rollout.batch import RolloutBatch
from rollout.ddim import DDIMLogProbSampler
from trainer.config import LearnerConfig, ObjectiveConfig
from trainer.kl import gaussian_kl_same_std
from trainer.objectives import StepInputs, get_objective

log = logging.getLogger(__name__)


def deepspeed_config(cfg: LearnerConfig, grad_accum: int) -> dict[str, Any]:
    """DeepSpeed JSON config; `torch_adam` avoids compiling the fused Adam op."""
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": grad_accum,
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


class DeepSpeedLearner:
    """Holds the policy engine, a frozen reference copy, the objective and its state."""

    def __init__(
        self,
        policy: nn.Module,
        sampler: DDIMLogProbSampler,
        objective_cfg: ObjectiveConfig,
        learner_cfg: LearnerConfig,
        seed: int = 0,
    ):
        import deepspeed

        self.sampler = sampler
        self.obj_cfg = objective_cfg
        self.cfg = learner_cfg
        self.objective = get_objective(objective_cfg.name)
        self.train_steps = torch.nonzero(sampler.trainable & (sampler.std >= objective_cfg.train_min_std)).flatten()
        if len(self.train_steps) == 0:
            raise ValueError(f"objective.train_min_std={objective_cfg.train_min_std} leaves no step to train "
                             f"(step stds: {[round(float(s), 4) for s in sampler.std]})")
        self.steps_per_sample = max(1, round(objective_cfg.timestep_fraction * len(self.train_steps)))
        self.reference = copy.deepcopy(policy).eval().requires_grad_(False)
        if not torch.distributed.is_initialized():
            deepspeed.init_distributed(dist_backend=learner_cfg.backend)
        self.engine, _, _, _ = deepspeed.initialize(
            model=policy,
            model_parameters=[p for p in policy.parameters() if p.requires_grad],
            config=deepspeed_config(learner_cfg, self.steps_per_sample),
        )
        self.generator = torch.Generator().manual_seed(seed)
        self.state: dict[str, Any] = {"updates": 0}

    @property
    def policy(self) -> nn.Module:
        return self.engine.module

    @torch.no_grad()
    def _recompute_old_logp(self, micro: list[RolloutBatch]) -> tuple[list[Tensor], dict[str, float]]:
        """Old log-probs at every trained step, micro-batched as the update is; plus KL monitor."""
        steps = self.train_steps
        out, diffs, kls = [], [], []
        for mb in micro:
            lp = torch.zeros_like(mb.old_logp)
            for s in steps.tolist():
                lp[:, s] = self.sampler.log_prob(self.engine, mb, s)
            diffs.append((lp[:, steps] - mb.old_logp[:, steps]).abs().max())
            out.append(lp)
            # KL(pi_theta || pi_ref) monitor: one random stochastic step per sample
            s = steps[torch.randint(len(steps), (len(mb),), generator=self.generator)]
            kls.append(self._kl_to_reference(mb, s))
        absdiff = float(torch.stack(diffs).max())
        if absdiff > self.cfg.logp_alarm:
            log.warning("recomputed old log-probs differ from the rollout's by %.2e (> %.0e): policy "
                        "weights out of sync or numerics drift", absdiff, self.cfg.logp_alarm)
        return out, {"policy/rollout_logp_absdiff_max": absdiff,
                     "policy/rollout_logp_alarm": float(absdiff > self.cfg.logp_alarm),
                     "policy/kl_ref_monitor": float(torch.cat(kls).mean())}

    def _kl_to_reference(self, mb: RolloutBatch, step: Tensor, mean: Tensor | None = None,
                         std: Tensor | None = None) -> Tensor:
        """Analytic per-sample KL of the policy step to the reference step (grad flows through `mean`)."""
        if mean is None or std is None:
            _, mean, std = self.sampler.log_prob(self.engine, mb, step, return_mean=True)
        with torch.no_grad():
            ref_mean, _ = self.sampler.step_mean(self.reference, mb.traj[torch.arange(len(mb)), step], step, mb.cond)
        return gaussian_kl_same_std(mean, ref_mean, std, self.sampler.cfg.logp_reduce)

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """One RL update over the whole batch; returns scalar metrics."""
        finite = batch.train_reward().isfinite()
        skipped = int((~finite).sum())
        if skipped:
            log.warning("skipping %d samples with non-finite rewards", skipped)
            batch = batch.index(torch.nonzero(finite).flatten())
        if len(batch) == 0:
            raise ValueError("no sample in the batch has a finite reward")
        adv = self.objective.advantages(batch, self.obj_cfg, self.state)
        batch = batch.replace(advantages=adv)
        perm = torch.randperm(len(batch), generator=self.generator)
        micro = batch.index(perm).split(self.cfg.micro_batch_size)
        old_logps, metrics = self._recompute_old_logp(micro)
        sums: dict[str, float] = defaultdict(float)
        count = opt_steps = 0
        grad_norms = []
        steps = self.train_steps
        self.engine.train()
        for _ in range(self.cfg.inner_epochs):
            for mb, old_lp in zip(micro, old_logps):
                rows = torch.arange(len(mb))
                chosen = torch.stack([steps[torch.randperm(len(steps), generator=self.generator)]
                                      [: self.steps_per_sample] for _ in rows])
                for j in range(self.steps_per_sample):
                    s = chosen[:, j]
                    new_lp, mean, std = self.sampler.log_prob(self.engine, mb, s, return_mean=True)
                    kl = self._kl_to_reference(mb, s, mean, std) if self.obj_cfg.kl_coef > 0 else None
                    inputs = StepInputs(new_logp=new_lp, old_logp=old_lp[rows, s], advantages=mb.advantages, kl_ref=kl)
                    loss, m = self.objective.loss(inputs, self.obj_cfg, self.state)
                    self.engine.backward(loss)
                    if j == self.steps_per_sample - 1:
                        pre_clip_norm = self._grad_norm()
                    self.engine.step()
                    for k, v in m.items():  # "*_max" metrics aggregate by max, the rest by mean
                        sums[k] = max(sums.get(k, -math.inf), float(v)) if k.endswith("_max") else sums[k] + float(v)
                    count += 1
                opt_steps += 1  # one optimiser step per micro-batch (GAS = steps_per_sample)
                gn = self.engine.get_global_grad_norm()  # set by ZeRO optimisers; None for stage 0
                gn = pre_clip_norm if gn is None else float(gn)
                if gn is not None and math.isfinite(gn):
                    grad_norms.append(gn)
        self.state["updates"] += 1
        metrics.update({k: (v if k.endswith("_max") else v / count) for k, v in sums.items()})
        metrics.update({
            "policy/grad_norm": sum(grad_norms) / max(1, len(grad_norms)),
            "policy/adv_abs_mean": float(adv.abs().mean()),
            "policy/optimizer_steps": float(opt_steps),
            "reward/nonfinite_skipped": float(skipped),
            "policy/lr": float(self.engine.get_lr()[0]),
        })
        return metrics

    def _grad_norm(self) -> float | None:
        """Global L2 norm of the accumulated (unclipped) gradients, where they live on the params."""
        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else None

    def weights(self) -> dict[str, Tensor]:
        """A CPU copy of the policy weights, to publish to rollout workers."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.policy.state_dict().items()}

    def save(self, directory: Path) -> None:
        """Engine (model + optimiser), reference, objective state and RNG."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(str(directory), tag="engine", save_latest=False)
        save_file({k: v.contiguous() for k, v in self.weights().items()}, str(directory / "policy.safetensors"))
        save_file({k: v.detach().contiguous() for k, v in self.reference.state_dict().items()},
                  str(directory / "reference.safetensors"))
        torch.save({"generator": self.generator.get_state()}, directory / "learner_rng.pt")
        (directory / "objective_state.json").write_text(json.dumps(self.state))

    def load(self, directory: Path) -> None:
        directory = Path(directory)
        self.engine.load_checkpoint(str(directory), tag="engine")
        self.reference.load_state_dict(load_file(str(directory / "reference.safetensors")))
        self.generator.set_state(torch.load(directory / "learner_rng.pt")["generator"])
        self.state = json.loads((directory / "objective_state.json").read_text())
