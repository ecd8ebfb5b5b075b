"""Collapse detection, for the controller's automatic rollback (`health.rollback`).

Each RL step's row of metrics is checked against the healthy rows before it (rows that raised no flag); W is the
last `window` of them and P the best mean over W seen so far (the level the run had reached):

    reward drop   r_t < P - max(drop * |P|, noise_sigmas * s)     the training reward (`reward/train_mean`); s the
                  population std over W: a fall of `drop` of the level reached, and beyond the batch noise
    gold drop     the same rule on the gold monitor (`reward/gold_mean`), where the testbed has one
    gradient      `policy/grad_norm` > grad_factor * median_W(grad_norm)
    ratio         `policy/ratio_mean` outside [1 / ratio_factor, ratio_factor]
    KL            `policy/kl_ref_monitor` > kl_max (off unless set: its scale is the model's)

A collapse is `patience` consecutive flagged rows (one bad batch is noise), or one row with a non-finite value.
Which weights are to blame: row t's rewards were measured on the rollout policy, at the earliest the weights after
t - 1 - s updates (s = learner.max_staleness); `Collapse.bad_version` is that version for the first flagged row of
the run of flags, and the controller restores the newest checkpoint before it.

Defaults, checked against every run of the stability benchmark (benchmarks/results/stability: 55 runs of 40
steps, replayed by tests/test_collapse.py). Its rule (final accuracy 15 points under the base) counts 13 collapses;
the detector flags 11 of them: all 6 StableDRL runs with 16 optimiser steps per batch (0.73 -> 0.10 in one update;
flagged by step 3 to 10) and all 5 d1 GRPO runs with independent masks (mean ratios above 400 from the first
update). It leaves the 2 BGPO runs that slid from 86 % to 67-69 % (a fall under `reward_drop`) and raises no alarm
in the other 42 runs, whose worst batch was 0.50 after a mean of 0.72 and whose one-step ratio means (up to 148)
and gradient spikes (up to 60x the median) passed.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from steadyrl.rollout.settings_base import StrictModel

NONFINITE = "not finite"
REWARD_KEY = "reward/train_mean"
GOLD_KEY = "reward/gold_mean"


class RollbackConfig(StrictModel):
    """Automatic rollback on collapse: restore the newest checkpoint before the collapse, lower the learning rate,
    continue."""

    enabled: bool = Field(False, description="detect collapses and roll back (writes a checkpoint at step 0 and "
                          "every checkpoint_every steps, so there is always a healthy one to go back to)")
    checkpoint_every: int = Field(5, ge=1, description="steps between the checkpoints a rollback can return to "
                                  "(beside run.checkpoint_every): the most work one rollback loses")
    lr_factor: float = Field(0.5, gt=0, lt=1, description="each rollback multiplies the learning rate by this: "
                             "the update that collapsed was too large a step for this batch statistics")
    max_rollbacks: int = Field(3, ge=1, description="after this many the run goes on without rolling back (a run "
                               "that collapses at a learning rate of lr x lr_factor^max_rollbacks needs another fix)")
    window: int = Field(5, ge=1, description="healthy rows the reward and gradient baselines are taken over")
    patience: int = Field(2, ge=1, description="consecutive rows a reward or gold drop must last: one bad batch "
                          "of a noisy reward is not a collapse")
    reward_drop: float = Field(0.5, gt=0, description="a drop of this fraction of the baseline's magnitude "
                               "(relative, so one setting serves accuracies, classifier scores and CLIP scores)")
    noise_sigmas: float = Field(3.0, ge=0, description="and a drop of more than this many standard deviations of "
                                "the baseline window (a noisy reward does not trip the relative rule)")
    grad_factor: float = Field(20.0, gt=1, description="a gradient norm this many times the window's median")
    ratio_factor: float = Field(10.0, gt=1, description="a mean importance ratio beyond this factor from 1")
    kl_max: float | None = Field(None, gt=0, description="a KL to the reference above this (None: not checked; "
                                 "its scale is the model's and the testbed's)")


@dataclass
class Collapse:
    """What the detector saw: the flags that made it a collapse and the earliest weights version to blame."""

    step: int
    reasons: list[str]
    bad_version: int


@dataclass
class CollapseDetector:
    """Stateful over a run (its state goes into the controller's checkpoint state)."""

    cfg: RollbackConfig
    staleness: int = 0
    healthy: list[dict[str, float]] = field(default_factory=list)  # the last `window` healthy rows
    pending: list[tuple[int, list[str]]] = field(default_factory=list)  # consecutive flagged rows
    peaks: dict[str, float] = field(default_factory=dict)  # best window mean of the reward and the gold so far

    def observe(self, step: int, row: dict[str, float]) -> Collapse | None:
        """Check row `step` (1-based: the row of the step's update); a `Collapse` when one is detected."""
        flags = self._drops(row) + self._explosions(row)
        if not flags:
            self.pending.clear()
            self.healthy = (self.healthy + [_kept(step, row)])[-self.cfg.window:]
            for key in (REWARD_KEY, GOLD_KEY):
                values = [h[key] for h in self.healthy if key in h]
                if values:
                    self.peaks[key] = max(self.peaks.get(key, -math.inf), statistics.fmean(values))
            return None
        self.pending.append((step, flags))
        if len(self.pending) < self.cfg.patience and not any(NONFINITE in f for f in flags):
            return None
        first = self.pending[0][0]
        reasons = [f for _, fs in self.pending for f in fs]
        return Collapse(step, list(dict.fromkeys(reasons)), max(0, first - 1 - self.staleness))

    def _drops(self, row: dict[str, float]) -> list[str]:
        flags = []
        for key in (REWARD_KEY, GOLD_KEY):
            value, window = row.get(key), [h[key] for h in self.healthy if key in h]
            if value is None or not window:
                continue
            if not math.isfinite(value):
                flags.append(f"{key} {NONFINITE} ({value})")
                continue
            peak, s = self.peaks[key], statistics.pstdev(window)
            limit = peak - max(self.cfg.reward_drop * abs(peak), self.cfg.noise_sigmas * s)
            if value < limit:
                flags.append(f"{key} {value:.4g} < {limit:.4g} (best window mean {peak:.4g})")
        return flags

    def _explosions(self, row: dict[str, float]) -> list[str]:
        cfg, flags = self.cfg, []
        grad = row.get("policy/grad_norm")
        norms = [h["policy/grad_norm"] for h in self.healthy if "policy/grad_norm" in h]
        if grad is not None and not math.isfinite(grad):
            flags.append(f"policy/grad_norm {NONFINITE} ({grad})")
        elif grad is not None and norms and grad > cfg.grad_factor * statistics.median(norms):
            flags.append(f"policy/grad_norm {grad:.4g} > {cfg.grad_factor:g} x window median")
        ratio = row.get("policy/ratio_mean")
        if ratio is not None and not math.isfinite(ratio):
            flags.append(f"policy/ratio_mean {NONFINITE} ({ratio})")
        elif ratio is not None and not 1 / cfg.ratio_factor <= ratio <= cfg.ratio_factor:
            flags.append(f"policy/ratio_mean {ratio:.4g} outside [1/{cfg.ratio_factor:g}, {cfg.ratio_factor:g}]")
        kl = row.get("policy/kl_ref_monitor")
        if cfg.kl_max is not None and kl is not None and not kl <= cfg.kl_max:
            flags.append(f"policy/kl_ref_monitor {kl:.4g} > {cfg.kl_max:g}")
        return flags

    def rewind(self, step: int) -> None:
        """After a rollback to checkpoint `step`: forget the rows after it."""
        self.healthy = [h for h in self.healthy if h["step"] <= step]
        self.pending.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"healthy": self.healthy, "pending": self.pending, "peaks": self.peaks}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.healthy = [dict(h) for h in state["healthy"]]
        self.pending = [(int(s), list(f)) for s, f in state["pending"]]
        self.peaks = {k: float(v) for k, v in state["peaks"].items()}


def _kept(step: int, row: dict[str, float]) -> dict[str, float]:
    """The row's step and the keys the baselines read."""
    return {"step": step, **{k: float(row[k]) for k in (REWARD_KEY, GOLD_KEY, "policy/grad_norm") if k in row}}
