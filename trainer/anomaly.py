"""Reward-hacking detection, for the controller's anomaly response (`health.anomaly`): the GARDO seed's idea of
regularising harder where the proxy reward is not to be trusted, applied to a whole run and any objective.

Two detectors over the rows of step metrics, each with its threshold:

    divergence     the proxy rises while the gold (held-out) reward falls. With p, g the means of
                   `reward/train_mean` and `reward/gold_mean` over the last `window` rows and p0, g0 over the
                   `window` rows before them:
                       d = (p - p0) / |p0| - (g - g0) / |g0|,   an event when p > p0, g < g0 and d > divergence
    disagreement   the reward ensemble's members disagree on how to rank the samples: `reward/uncertainty_mean`
                   (each sample's std over members of its normalised rank within its prompt group, in [0, 0.5])
                   above `disagreement` (off unless set; 0 with one member)

The response (the controller's): multiply the KL weight by `kl_boost` for the next `boost_steps` updates (an
event during a boost extends it), save the step's batch (samples and scores) to the run folder, count the event.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field

from steadyrl.rollout.settings_base import StrictModel

PROXY_KEY = "reward/train_mean"
GOLD_KEY = "reward/gold_mean"
DISAGREEMENT_KEY = "reward/uncertainty_mean"


class AnomalyConfig(StrictModel):
    """Reward-hacking detection and the response to it."""

    enabled: bool = Field(False, description="watch for reward hacking and answer each event by raising the KL "
                          "weight (needs objective.kl_coef > 0) and saving the batch")
    window: int = Field(5, ge=1, description="rows averaged on each side of the divergence comparison: a trend, "
                        "not one batch")
    divergence: float = Field(0.1, gt=0, description="the proxy's relative rise minus the gold's relative change "
                              "(both over `window` rows) past which the proxy is being gamed")
    disagreement: float | None = Field(None, gt=0, le=0.5, description="mean rank disagreement of the reward "
                                       "ensemble past which an event is raised (None: not checked)")
    kl_boost: float = Field(10.0, gt=1, description="factor on the KL weight while an event is answered")
    boost_steps: int = Field(5, ge=1, description="updates the boost lasts after the latest event")
    save_batches: int = Field(10, ge=0, description="at most this many offending batches are written to "
                              "anomalies/ (disk stays bounded in a long run that keeps tripping)")


@dataclass
class Anomaly:
    step: int
    kind: str
    value: float
    threshold: float


@dataclass
class HackingDetector:
    cfg: AnomalyConfig
    rows: list[dict[str, float]] = field(default_factory=list)

    def observe(self, step: int, row: dict[str, float]) -> Anomaly | None:
        """Add row `step`; the event it raises, if any (divergence first)."""
        self.rows = (self.rows + [{k: float(row[k]) for k in (PROXY_KEY, GOLD_KEY) if k in row}])[-2 * self.cfg.window:]
        d = self.divergence()
        if d is not None and d > self.cfg.divergence:
            return Anomaly(step, "divergence", d, self.cfg.divergence)
        u = row.get(DISAGREEMENT_KEY)
        if self.cfg.disagreement is not None and u is not None and u > self.cfg.disagreement:
            return Anomaly(step, "disagreement", float(u), self.cfg.disagreement)
        return None

    def divergence(self) -> float | None:
        """d over the stored rows, or None while there are fewer than 2 x window rows with both rewards, or when
        the proxy did not rise or the gold did not fall."""
        w = self.cfg.window
        rows = [r for r in self.rows if PROXY_KEY in r and GOLD_KEY in r]
        if len(rows) < 2 * w:
            return None
        p0, p = (statistics.fmean(r[PROXY_KEY] for r in part) for part in (rows[:w], rows[w:]))
        g0, g = (statistics.fmean(r[GOLD_KEY] for r in part) for part in (rows[:w], rows[w:]))
        if not (p > p0 and g < g0):
            return None
        return (p - p0) / max(abs(p0), 1e-12) - (g - g0) / max(abs(g0), 1e-12)

    def rewind(self, step: int) -> None:
        """After a rollback: the rows are of an abandoned branch."""
        self.rows.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"rows": self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows = [dict(r) for r in state["rows"]]
