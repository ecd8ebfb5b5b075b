"""The controller's watch over a run's health (`health:` in the config): it answers reward-hacking events
(trainer/anomaly.py) and decides rollbacks on collapse (trainer/collapse.py), and records both in the run folder.

    anomalies.jsonl          one line per event: step, kind, value, threshold, kl_boost, until_step, batch
    anomalies/step_NNNN/     the offending batch (batch.safetensors: samples, conditions, groups, every score)
    rollbacks.jsonl          one line per rollback: step, restored_step, reasons, lr_scale, rollback
    rollbacks/rollback_N_metrics.jsonl   the metric rows of the abandoned steps

Its state (the factors in force, counts, the detectors' windows) travels in each checkpoint's controller state,
so a resumed run answers as the uninterrupted one would.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from steadyrl.services.config import HealthConfig
from steadyrl.trainer.anomaly import Anomaly, HackingDetector
from steadyrl.trainer.collapse import Collapse, CollapseDetector
from steadyrl.trainer.controls import UpdateControls

ANOMALIES, ROLLBACKS = "anomalies", "rollbacks"


class RunHealth:
    """Detectors, the factors they set on the learner's updates, and the run-folder records."""

    def __init__(self, cfg: HealthConfig, run_dir: Path, staleness: int = 0):
        self.cfg, self.run_dir = cfg, Path(run_dir)
        self.hacking = HackingDetector(cfg.anomaly) if cfg.anomaly.enabled else None
        self.collapse = CollapseDetector(cfg.rollback, staleness) if cfg.rollback.enabled else None
        self.lr_scale = 1.0
        self.boost_until = 0  # updates of steps before this (0-based) run with the KL weight boosted
        self.events = self.rollbacks = self.saved = 0

    def controls(self, step: int) -> UpdateControls:
        """The factors for the update of (0-based) `step`."""
        return UpdateControls(self.lr_scale, self.cfg.anomaly.kl_boost if step < self.boost_until else 1.0)

    def watch(self, steps_done: int, metrics: dict[str, float], learner: Any) -> Collapse | None:
        """Row `steps_done`'s metrics: answer a hacking event (boost the KL weight, save the batch through
        `learner.save_batch`, record it); return a collapse when a rollback is due. Adds the counts to `metrics`."""
        event = self.hacking.observe(steps_done, metrics) if self.hacking else None
        if event is not None:
            self._answer(event, learner)
        collapse = self.collapse.observe(steps_done, metrics) if self.collapse else None
        metrics["health/anomaly_events"] = float(self.events)
        metrics["health/rollbacks"] = float(self.rollbacks)
        if collapse is not None and self.rollbacks >= self.cfg.rollback.max_rollbacks:
            return None  # the budget is spent: the run goes on as it is (the flags stay in the log)
        return collapse

    def _answer(self, event: Anomaly, learner: Any) -> None:
        self.events += 1
        self.boost_until = event.step + self.cfg.anomaly.boost_steps
        batch = None
        if self.saved < self.cfg.anomaly.save_batches:
            batch = f"{ANOMALIES}/step_{event.step:04d}"
            learner.save_batch(str(self.run_dir / batch))
            self.saved += 1
        self._append(ANOMALIES, {"step": event.step, "kind": event.kind, "value": event.value,
                                 "threshold": event.threshold, "kl_boost": self.cfg.anomaly.kl_boost,
                                 "until_step": self.boost_until, "batch": batch})

    def rolled_back(self, collapse: Collapse, restored_step: int, abandoned_rows: list[str]) -> None:
        """Record a rollback to checkpoint `restored_step`: lower the lr, rewind the detectors, log it."""
        self.rollbacks += 1
        self.lr_scale *= self.cfg.rollback.lr_factor
        self.boost_until = min(self.boost_until, restored_step)
        for detector in (self.collapse, self.hacking):
            if detector is not None:
                detector.rewind(restored_step)
        folder = self.run_dir / ROLLBACKS
        folder.mkdir(exist_ok=True)
        (folder / f"rollback_{self.rollbacks}_metrics.jsonl").write_text("".join(r + "\n" for r in abandoned_rows))
        self._append(ROLLBACKS, {"step": collapse.step, "restored_step": restored_step, "reasons": collapse.reasons,
                                 "lr_scale": self.lr_scale, "rollback": self.rollbacks})

    def _append(self, name: str, record: dict[str, Any]) -> None:
        with (self.run_dir / f"{name}.jsonl").open("a") as f:
            f.write(json.dumps(record) + "\n")

    def state_dict(self) -> dict[str, Any]:
        return {"lr_scale": self.lr_scale, "boost_until": self.boost_until, "events": self.events,
                "rollbacks": self.rollbacks, "saved": self.saved,
                "hacking": self.hacking.state_dict() if self.hacking else None,
                "collapse": self.collapse.state_dict() if self.collapse else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.lr_scale, self.boost_until = float(state["lr_scale"]), int(state["boost_until"])
        self.events, self.rollbacks, self.saved = int(state["events"]), int(state["rollbacks"]), int(state["saved"])
        if self.hacking and state.get("hacking"):
            self.hacking.load_state_dict(state["hacking"])
        if self.collapse and state.get("collapse"):
            self.collapse.load_state_dict(state["collapse"])
