"""Reading a run folder back, and what `steadyrl inspect` concludes from it: key-metric summaries and the
reward-hacking verdict. Nothing here needs the run's models: only the files `steadyrl train` wrote.

    config.yaml  metrics.jsonl  evals.json  samples_step_NNNN.{png,txt}  rollbacks.jsonl  anomalies.jsonl
    recoveries.jsonl
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import Field

from steadyrl.rollout.settings_base import StrictModel
from steadyrl.services.run_folder.metrics import read_metrics
from steadyrl.services.run_folder.recoveries import read_recoveries

SAMPLE_SUFFIXES = (".png", ".txt", ".md", ".json")  # what a testbed's save_eval writes next to samples_step_NNNN


class NotARunFolder(ValueError):
    """The path is not a folder written by `steadyrl train`; the message names it."""


@dataclass
class RunFolder:
    """One run's files, read once. `samples` maps an eval step to the files its testbed saved."""

    path: Path
    config_text: str
    metrics: list[dict[str, float]]
    evals: list[dict[str, Any]]
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    samples: dict[int, list[Path]] = field(default_factory=dict)
    recoveries: list[dict[str, Any]] = field(default_factory=list)  # restarts after a lost process or node

    @property
    def name(self) -> str:
        return self.path.resolve().name

    def keys(self) -> list[str]:
        """Every metric key any step logged, in first-seen order."""
        seen: dict[str, None] = {}
        for row in self.metrics:
            seen.update(dict.fromkeys(k for k in row if k != "step"))
        return list(seen)

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(steps, values) of a metric over the steps that logged it; `eval/<field>` reads evals.json instead."""
        if key.startswith("eval/"):
            name = key[len("eval/"):]
            rows = [e for e in self.evals if isinstance(e.get(name), (int, float))]
            return [float(e["step"]) for e in rows], [float(e[name]) for e in rows]
        rows = [r for r in self.metrics if key in r]
        return [float(r["step"]) for r in rows], [float(r[key]) for r in rows]

    def has(self, key: str) -> bool:
        return bool(self.series(key)[0])


def run_labels(runs: list[RunFolder]) -> list[str]:
    """Folder names, with the parent folder prepended where two runs share a name."""
    names = [r.name for r in runs]
    return [f"{r.path.resolve().parent.name}/{n}" if names.count(n) > 1 else n for r, n in zip(runs, names)]


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_run_folder(path: str | Path) -> Path:
    """`path`, when it is a run folder; else NotARunFolder naming it (no such directory, or no config.yaml)."""
    path = Path(path)
    if not path.is_dir():
        raise NotARunFolder(f"{path} is not a run folder (no such directory)")
    if not (path / "config.yaml").is_file():
        raise NotARunFolder(f"{path} is not a run folder (no config.yaml; `steadyrl train` writes one)")
    return path


def read_evals(run_dir: str | Path) -> list[dict[str, Any]]:
    """The run's evaluations (evals.json: one per eval step, the base first); none before the first."""
    path = Path(run_dir) / "evals.json"
    return json.loads(path.read_text()) if path.exists() else []


def load_run(path: str | Path) -> RunFolder:
    """Read a run folder; raises NotARunFolder naming `path` when it has no config.yaml."""
    path = check_run_folder(path)
    samples: dict[int, list[Path]] = {}
    for f in sorted(path.glob("samples_step_*")):
        stem = f.name.split(".")[0]
        if f.suffix in SAMPLE_SUFFIXES and stem[len("samples_step_"):].isdigit():
            samples.setdefault(int(stem[len("samples_step_"):]), []).append(f)
    return RunFolder(path=path, config_text=(path / "config.yaml").read_text(), metrics=read_metrics(path),
                     evals=read_evals(path),
                     rollbacks=_jsonl(path / "rollbacks.jsonl"), anomalies=_jsonl(path / "anomalies.jsonl"),
                     samples=samples, recoveries=read_recoveries(path))


# ---------------------------------------------------------------------------------------- key metrics
KEY_METRICS: tuple[str, ...] = (
    "reward/train_mean", "reward/ensemble_mean", "reward/held_out", "reward/gold_mean", "diversity/nn_distance",
    "policy/kl_ref_monitor", "policy/ratio_mean", "policy/ratio_std", "policy/ratio_max", "policy/grad_norm",
    "health/adv_std", "health/zero_std_group_frac", "gardo/gate_frac", "policy/clip_frac", "stabledrl/cap_frac",
    "policy/lr_scale", "health/kl_boost", "health/rollbacks", "health/anomaly_events",
)


@dataclass
class MetricSummary:
    key: str
    last: float
    min: float
    min_step: int
    max: float
    max_step: int


def summarize(run: RunFolder, keys: tuple[str, ...] | list[str] = KEY_METRICS) -> list[MetricSummary]:
    """Last, min and max (with their steps) of each key the run logged, over its finite values."""
    out = []
    for key in keys:
        steps, values = run.series(key)
        pairs = [(s, v) for s, v in zip(steps, values) if math.isfinite(v)]
        if not pairs:
            continue
        lo, hi = min(pairs, key=lambda p: p[1]), max(pairs, key=lambda p: p[1])
        out.append(MetricSummary(key, pairs[-1][1], lo[1], int(lo[0]), hi[1], int(hi[0])))
    return out


# ---------------------------------------------------------------------------------------- the verdict
class HackingRule(StrictModel):
    """Thresholds of the reward-hacking verdict; base = the first evaluation (step 0), final = the last."""

    min_proxy_gain: float = Field(0.02, ge=0, description="proxy reward rise since the base eval (absolute) that, "
                                  "with the gold drop below, counts as hacking: the policy pleases the reward "
                                  "models it trains on while the held-out judge disagrees")
    min_gold_drop: float = Field(0.02, ge=0, description="held-out (gold) drop since the base eval (absolute) that, "
                                 "with the proxy gain above, counts as hacking")
    max_diversity_drop: float = Field(0.5, gt=0, le=1, description="relative fall of the nearest-neighbour feature "
                                      "diversity since the base eval that counts as hacking on its own (mode "
                                      "collapse onto what the proxy likes)")

    def statement(self) -> str:
        return (f"reward hacking is suspected when, from the base eval to the final one, the proxy reward rose by "
                f">= {self.min_proxy_gain:g} while the held-out (gold) score fell by >= {self.min_gold_drop:g}, "
                f"or the nearest-neighbour diversity fell by more than {self.max_diversity_drop:.0%}")


@dataclass
class Verdict:
    suspected: bool | None  # None: fewer than two evaluations
    text: str
    rule: str
    proxy_gain: float = math.nan
    gold_drop: float = math.nan
    diversity_drop: float = math.nan


def hacking_verdict(evals: list[dict[str, Any]], rule: HackingRule | None = None) -> Verdict:
    """Compare the first and last evaluation:

        proxy_gain = final.proxy_mean - base.proxy_mean;  gold_drop = base.held_out - final.held_out
        diversity_drop = (base.diversity_nn - final.diversity_nn) / base.diversity_nn
        suspected = (proxy_gain >= min_proxy_gain and gold_drop >= min_gold_drop)
                    or diversity_drop > max_diversity_drop
    """
    rule = rule or HackingRule()
    if len(evals) < 2:
        return Verdict(None, "no verdict: fewer than two evaluations", rule.statement())
    base, final = evals[0], evals[-1]
    proxy_gain = float(final["proxy_mean"]) - float(base["proxy_mean"])
    gold_drop = float(base["held_out"]) - float(final["held_out"])
    b_div, f_div = float(base.get("diversity_nn", math.nan)), float(final.get("diversity_nn", math.nan))
    diversity_drop = (b_div - f_div) / b_div if b_div > 0 else math.nan
    reasons = []
    if proxy_gain >= rule.min_proxy_gain and gold_drop >= rule.min_gold_drop:
        reasons.append(f"proxy +{proxy_gain:.3f} while gold -{gold_drop:.3f}")
    if diversity_drop > rule.max_diversity_drop:
        reasons.append(f"diversity fell {diversity_drop:.0%}")
    span = f"step {base['step']} -> {final['step']}"
    if reasons:
        text = f"reward hacking suspected ({span}): " + "; ".join(reasons)
    else:
        diversity = "n/a (no features)" if math.isnan(diversity_drop) else f"{-diversity_drop:+.0%}"
        text = (f"no sign of reward hacking ({span}): proxy {proxy_gain:+.3f}, gold {-gold_drop:+.3f}, "
                f"diversity {diversity}")
    return Verdict(bool(reasons), text, rule.statement(), proxy_gain, gold_drop, diversity_drop)
