"""CPU/GPU parity of a run's first step, from the same seed and weights, with the local runtime's own parts.

`first_step(cfg, device)` builds what `steadyrl train --local` builds (the testbed's base weights, one
`Rollouts` worker, the in-process reward ensemble, one DeepSpeed learner rank) on `device` and records:

    rollout_logp     the rollout's stored per-step log-probs of its own samples             [B, T]
    recomputed_logp  the learner's no-grad recompute at the base weights, on the reference batch
    alarm            the recompute alarm on its own samples (|recomputed - rollout| > learner.logp_alarm)
    loss, grad_norm  one update (one optimiser step) on the reference batch
    sync             one weight sync: the learner's weights published to the rollout copy, then compared

The reference batch is the CPU run's own batch; the GPU run is given it (`reference`), so that the recompute,
the loss and the gradient compare the two devices' numerics on the same samples, while the rollout log-probs
compare the two samplers from the same noise (drawn on the CPU: `torch.Generator()`). `compare` states the
tolerances: tight in float32 (TF32 off), looser in bfloat16.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

#: |a - b| <= tol * max(1, |b|) for log-probs; |a - b| <= tol * scale for the loss (scale: max(|b|, mean |A|));
#: |a - b| <= tol * |b| for the gradient norm
TOLERANCES = {"float32": {"logp": 1e-3, "loss": 1e-3, "grad_norm": 1e-3},
              "bfloat16": {"logp": 5e-2, "loss": 1e-1, "grad_norm": 1e-1}}


def one_update_overrides(samples: int) -> list[str]:
    """One optimiser step over the whole first batch, recomputing the old log-probs: the loss and gradient norm
    of the first step are then functions of the base weights and the batch alone."""
    return [f"learner.micro_batch_size={samples}", f"learner.optim_batch_size={samples}", "learner.inner_epochs=1",
            "learner.old_logp=recompute", "run.steps=1"]


def first_step(cfg: Any, device: str, reference: Any | None = None) -> dict[str, Any]:
    """The first step's figures on `device` ("cpu" or "cuda"); `reference`: the batch the learner trains on
    (None: its own). TF32 is off, so float32 compares float32."""
    from safetensors.torch import load_file

    from steadyrl.rollout.policy import trainable_state
    from steadyrl.services.runtime.local_runtime import LocalLearner, LocalScorer
    from steadyrl.services.runtime.rollouts import Rollouts
    from steadyrl.services.testbeds import build_testbed
    from steadyrl.trainer.recompute import recompute_old

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    testbed = build_testbed(cfg)
    testbed.preflight()
    base = load_file(str(testbed.base_weights(progress=False)))
    testbed.prepare_rewards(None)
    rollouts = Rollouts(cfg, base, torch.device(device))
    own, _ = rollouts.generate(1, 0, 1, LocalScorer(testbed.reward_ensemble()))
    own = own.to(device="cpu")
    learner = LocalLearner(cfg, base)
    learner.start()
    trainer = learner.learner
    batch = own if reference is None else reference

    def recompute(b):
        trainer.last_batch = b  # the batch whose trained steps the recompute reads
        olds, metrics = recompute_old(trainer.context(), [b.to(device=trainer.device)], 0, cfg.learner)
        return olds[0].logp.detach().cpu(), metrics

    # two recomputes on both devices, even where `batch` is `own` (the CPU): each draws from the learner's generator
    # (the KL monitor's random step per sample), which must stand where the other device's stands when the update
    # draws its own
    _, own_metrics = recompute(own)
    recomputed, _ = recompute(batch)
    metrics = learner.update([batch])
    t0 = time.perf_counter()
    weights = learner.sampling_weights()
    rollouts.load(1, weights)
    held = trainable_state(rollouts.policy)
    sync_s = time.perf_counter() - t0
    return {
        "device": device, "batch": own, "rollout_logp": own.old_logp, "recomputed_logp": recomputed,
        "trained_steps": trainer.batch_train_steps().cpu(),
        "alarm": own_metrics["policy/rollout_logp_alarm"], "absdiff": own_metrics["policy/rollout_logp_absdiff_max"],
        "loss": float(metrics.get("policy/pg_loss", metrics.get("policy/loss", math.nan))),
        "grad_norm": float(metrics["policy/grad_norm"]), "adv_abs_mean": float(metrics["policy/adv_abs_mean"]),
        "sync": {"bytes": sum(v.numel() * v.element_size() for v in weights.values()), "seconds": sync_s,
                 "equal": sorted(held) == sorted(weights)
                 and all(torch.equal(held[k].detach().cpu(), weights[k].cpu()) for k in weights)},
    }


@dataclass
class Check:
    """One compared quantity: its error in the tolerance's own unit, the tolerance, and whether it holds."""

    error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance

    def row(self) -> dict[str, Any]:
        return {"error": self.error, "tolerance": self.tolerance, "ok": self.ok}


def logp_error(a: torch.Tensor, b: torch.Tensor, steps: torch.Tensor) -> float:
    """max |a - b| / max(1, |b|) over the trained steps' finite entries (untrained steps hold 0 or NaN)."""
    a, b = a[:, steps].double(), b[:, steps].double()
    finite = a.isfinite() & b.isfinite()
    if not finite.any():
        return math.nan
    return float(((a - b).abs() / b.abs().clamp(min=1.0))[finite].max())


def compare(gpu: dict[str, Any], cpu: dict[str, Any], dtype: str) -> dict[str, Any]:
    """Every parity check of a GPU first step against the CPU's, with `TOLERANCES[dtype]`."""
    tol = TOLERANCES[dtype]
    steps = cpu["trained_steps"]
    scale = max(abs(cpu["loss"]), cpu["adv_abs_mean"], 1e-12)
    checks = {
        "rollout_logp": Check(logp_error(gpu["rollout_logp"], cpu["rollout_logp"], steps), tol["logp"]),
        "recomputed_logp": Check(logp_error(gpu["recomputed_logp"], cpu["recomputed_logp"], steps), tol["logp"]),
        "loss": Check(abs(gpu["loss"] - cpu["loss"]) / scale, tol["loss"]),
        "grad_norm": Check(abs(gpu["grad_norm"] - cpu["grad_norm"]) / max(abs(cpu["grad_norm"]), 1e-12),
                           tol["grad_norm"]),
        "recompute_alarm_silent": Check(float(gpu["alarm"]), 0.0),
        "weight_sync_equal": Check(0.0 if gpu["sync"]["equal"] else 1.0, 0.0),
    }
    return {"ok": all(c.ok for c in checks.values()), **{k: c.row() for k, c in checks.items()}}
