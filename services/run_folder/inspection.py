"""`steadyrl inspect` and `steadyrl compare`: a run folder (or several) -> tables, PNGs and the HTML report."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from rich.table import Table

from steadyrl.services.run_folder.dashboard import DEFAULT_COMPARE, save_comparison, save_dashboard
from steadyrl.services.run_folder.figures import save_held_out_vs_time
from steadyrl.services.run_folder.html_report import write_report
from steadyrl.services.run_folder.reader import (HackingRule, MetricSummary, RunFolder, Verdict, hacking_verdict, load_run,
                                          run_labels, summarize)
from steadyrl.services.run_folder.time_to_target import TimeToTarget, held_out_curve, time_to_target


@dataclass
class Inspection:
    run: RunFolder
    summary: list[MetricSummary]
    verdict: Verdict
    dashboard: Path | None
    report: Path
    to_target: TimeToTarget | None = None  # with a target held-out


def inspect_run(run_dir: str | Path, out: str | Path | None = None, rule: HackingRule | None = None,
                target: float | None = None) -> Inspection:
    """Read the run, write `out`/dashboard.png and `out`/report.html (default out: RUN_DIR/report); with `target`,
    the run's time to that held-out."""
    run = load_run(run_dir)
    out = Path(out) if out is not None else run.path / "report"
    out.mkdir(parents=True, exist_ok=True)
    summary, verdict = summarize(run), hacking_verdict(run.evals, rule)
    dashboard = save_dashboard(run, out / "dashboard.png")
    report = write_report(run, summary, verdict, dashboard, out / "report.html")
    return Inspection(run, summary, verdict, dashboard, report,
                      None if target is None else time_to_target(run, target))


def _f(value: float) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.4g}"


def inspection_tables(ins: Inspection) -> list[Table]:
    """Key metrics (last/min/max), base vs final eval, the rollbacks and anomaly events, and the restarts."""
    run = ins.run
    metrics = Table(title=f"{run.name}: {len(run.metrics)} steps logged")
    for col in ("metric", "last", "min (step)", "max (step)"):
        metrics.add_column(col, justify="left" if col == "metric" else "right")
    for m in ins.summary:
        metrics.add_row(m.key, _f(m.last), f"{_f(m.min)} ({m.min_step})", f"{_f(m.max)} ({m.max_step})")
    tables = [metrics]
    if run.evals:
        evals = Table(title="evaluations: base vs final")
        for col in ("", f"base (step {run.evals[0]['step']})", f"final (step {run.evals[-1]['step']})"):
            evals.add_column(col, justify="right" if col else "left")
        for key, label in (("held_out", "held-out (gold)"), ("proxy_mean", "proxy reward"),
                           ("diversity_nn", "diversity (nn)")):
            evals.add_row(label, _f(run.evals[0].get(key)), _f(run.evals[-1].get(key)))
        tables.append(evals)
    events = Table(title=f"{len(run.rollbacks)} rollback(s), {len(run.anomalies)} anomaly event(s)")
    for col in ("step", "event", "details"):
        events.add_column(col)
    for r in run.rollbacks:
        events.add_row(str(r.get("step")), f"rollback {r.get('rollback')}",
                       f"restored step {r.get('restored_step')}, lr scale {_f(r.get('lr_scale'))}: "
                       + "; ".join(r.get("reasons", [])))
    for a in run.anomalies:
        events.add_row(str(a.get("step")), f"anomaly {a.get('kind')}",
                       f"value {_f(a.get('value'))} vs threshold {_f(a.get('threshold'))}, KL x{_f(a.get('kl_boost'))} "
                       f"until step {a.get('until_step')}, batch {a.get('batch')}")
    if run.rollbacks or run.anomalies:
        tables.append(events)
    if run.recoveries:
        lost = sum(r.get("steps_redone", 0) for r in run.recoveries)
        seconds = sum(r.get("recovery_s", 0.0) for r in run.recoveries)
        restarts = Table(title=f"{len(run.recoveries)} restart(s) after a lost process or node: {lost} step(s) "
                               f"redone, {seconds:.0f} s recovering")
        for col in ("restart", "failed at step", "resumed from", "steps redone", "recovery (s)", "cause"):
            restarts.add_column(col, justify="left" if col == "cause" else "right")
        for r in run.recoveries:
            restarts.add_row(str(r.get("restart")), str(r.get("failed_step")), str(r.get("resumed_from_step")),
                             str(r.get("steps_redone")), _f(r.get("recovery_s")), str(r.get("cause")))
        tables.append(restarts)
    if ins.to_target is not None:
        tables.append(to_target_table([run.name], [ins.to_target]))
    return tables


def to_target_table(labels: list[str], times: list[TimeToTarget]) -> Table:
    """One row per run: the first evaluated step at the target, the training seconds and samples up to it."""
    table = Table(title=f"time to {times[0].target:.1%} held-out (first evaluation at or above it; seconds of "
                        "training steps, evaluations and start-up apart)")
    for col in ("run", "step", "training (s)", "samples", "best held-out (step)", "evaluations"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for label, t in zip(labels, times):
        best = "-" if t.best_step is None else f"{t.best:.1%} ({t.best_step})"
        table.add_row(label, str(t.step) if t.reached else "not reached", _f(t.train_s), _f(t.samples), best,
                      str(t.evals))
    return table


@dataclass
class Comparison:
    runs: list[RunFolder]
    keys: list[str]
    figure: Path
    to_target: list[TimeToTarget] | None = None  # with a target held-out, each run's time to it
    time_figure: Path | None = None  # ... and their held-out against training seconds


def compare_runs(run_dirs: list[str | Path], out: str | Path, keys: list[str] | None = None,
                 target: float | None = None) -> Comparison:
    """Overlay the runs' curves of `keys` (default DEFAULT_COMPARE) in `out`/compare.png. A key given explicitly
    that no run logged is an error naming it; a default key no run has is left out. With `target`, each run's
    time to that held-out and `out`/held_out_vs_time.png."""
    runs = [load_run(d) for d in run_dirs]
    if keys:
        missing = [k for k in keys if not any(r.has(k) for r in runs)]
        if missing:
            raise KeyError(f"--metric {', '.join(missing)}: no run logged it (keys: metrics.jsonl names such as "
                           f"reward/train_mean, or eval/<field> of evals.json such as eval/held_out)")
    keys = [k for k in (keys or DEFAULT_COMPARE) if any(r.has(k) for r in runs)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmp = Comparison(runs, keys, save_comparison(runs, keys, out / "compare.png"))
    if target is not None:
        cmp.to_target = [time_to_target(run, target) for run in runs]
        cmp.time_figure = save_held_out_vs_time(
            {label: [held_out_curve(run)] for label, run in zip(run_labels(runs), runs)}, target,
            out / "held_out_vs_time.png")
    return cmp


def comparison_table(cmp: Comparison, rule: HackingRule | None = None) -> Table:
    """One row per run: steps, the final value of each key, events and the hacking verdict."""
    table = Table(title="compare (final values)")
    table.add_column("run")
    table.add_column("steps", justify="right")
    for k in cmp.keys:
        table.add_column(k, justify="right")
    table.add_column("rollbacks / anomalies", justify="right")
    table.add_column("verdict")
    for run, label in zip(cmp.runs, run_labels(cmp.runs)):
        finals = [_f(run.series(k)[1][-1]) if run.has(k) else "-" for k in cmp.keys]
        verdict = hacking_verdict(run.evals, rule)
        short = {None: "no verdict", True: "HACKING SUSPECTED", False: "ok"}[verdict.suspected]
        last = str(int(run.metrics[-1]["step"])) if run.metrics else "0"
        table.add_row(label, last, *finals, f"{len(run.rollbacks)} / {len(run.anomalies)}", short)
    return table
