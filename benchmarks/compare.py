"""Side-by-side comparison runs: (variant, seed) pairs in parallel processes, then one table and one plot.

Shared by benchmarks/hacking.py, benchmarks/near_deterministic_step.py and benchmarks/stability.py. A variant
is (label, objective preset, overrides); each run is `steadyrl train --local` (the product loop in one process,
on one torch thread), read back from its run folder.
"""
from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def preset(method: str) -> Path:
    """A method's digits preset (`grpo_guard.paper` -> configs/digits-grpo-guard-paper.yaml), or a path to a
    preset given directly (`configs/arith-bgpo.yaml`)."""
    if method.endswith(".yaml"):
        return ROOT / method
    return ROOT / "configs" / f"digits-{method.replace('.', '-').replace('_', '-')}.yaml"


# per-step columns of the tables, from the run's metrics.jsonl
ROW_KEYS = {"proxy": "reward/train_mean", "held_out": "reward/held_out",
            "diversity_nn": "diversity/nn_distance", "diversity_pairwise": "diversity/pairwise_distance",
            "step_s": "timing_s/step", "sync_bytes": "sync/bytes", "logp_absdiff_max": "policy/rollout_logp_absdiff_max"}
KEPT_PREFIXES = ("policy/", "gardo/", "guard/", "stabledrl/", "bgpo/")


def one_run(label: str, method: str, seed: int, overrides: list[str], run_dir: Path, eval_every: int
            ) -> dict[str, Any]:
    """One (variant, seed) run of the product loop in this process; `label` names the variant in tables and
    plots. Its rows end at the first step whose update was not finite (`stopped_at`: a collapse)."""
    from steadyrl.services.driver.controller import train
    from steadyrl.services.run_folder.metrics import read_metrics

    t0 = time.perf_counter()
    result = train(preset(method), [f"run.seed={seed}", "ray.torch_threads=1", *overrides, "run.runtime=local",
                                    "run.progress=false", f"run.eval_every={eval_every}", f"run.run_dir={run_dir}"])
    rows, stopped = [], None
    for m in read_metrics(result.run_dir):
        row = {"step": m["step"], **{k: m.get(key, 0.0) for k, key in ROW_KEYS.items()},
               **{k: v for k, v in m.items() if k.startswith(KEPT_PREFIXES)}}
        rows.append(row)
        if not all(math.isfinite(m.get(k, 0.0)) for k in ("policy/grad_norm", "policy/pg_loss")):
            stopped = m["step"]
            break
    evals = [{k: v for k, v in e.items() if k not in ("grid", "examples", "images", "captions")}
             for e in json.loads((result.run_dir / "evals.json").read_text())]
    if stopped is not None:
        evals = [e for e in evals if e["step"] < stopped] + [{"step": stopped, "held_out": 0.0,
                                                              "nonfinite_weights": True}]
    events = {name: [json.loads(line) for line in (result.run_dir / f"{name}.jsonl").read_text().splitlines()]
              if (result.run_dir / f"{name}.jsonl").exists() else [] for name in ("rollbacks", "anomalies")}
    return {"method": label, "objective": method, "seed": seed, "overrides": overrides,
            "wall_s": time.perf_counter() - t0, "rows": rows, "evals": evals, "stopped_at": stopped, **events}


def warm_caches(cfg: Any) -> None:
    """Build (or find) the cached base model and reward models of a run's config once, before runs start in
    parallel."""
    from steadyrl.services.testbeds import build_testbed

    testbed = build_testbed(cfg)
    testbed.base_weights(progress=True)
    testbed.prepare_rewards()


def run_all(variants: list[tuple[str, str, list[str]]], seeds: list[int], jobs: int, eval_every: int) -> list[dict[str, Any]]:
    """Every (label, method, overrides) variant for every seed, `jobs` processes at a time (run folders in a
    temporary directory: the results are what is kept)."""
    todo = [(label, method, seed, overrides) for seed in seeds for label, method, overrides in variants]
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="steadyrl-bench-") as tmp, \
            ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
        futures = [pool.submit(one_run, label, method, seed, overrides, Path(tmp) / f"run{i}", eval_every)
                   for i, (label, method, seed, overrides) in enumerate(todo)]
        for (label, _, seed, _), fut in zip(todo, futures):
            runs.append(fut.result())
            first, last = runs[-1]["evals"][0], runs[-1]["evals"][-1]
            print(f"[{time.perf_counter() - t0:7.0f}s] {label} seed {seed}: gold {first['held_out']:.1%} -> "
                  f"{last['held_out']:.1%}, proxy {first['proxy_mean']:.3f} -> {last.get('proxy_mean', 0):.3f}, "
                  f"nn diversity {first['diversity_nn']:.2f} -> {last.get('diversity_nn', 0):.2f}", flush=True)
    return runs


def write_results(runs: list[dict[str, Any]], setting: str, out: Path, extra: dict[str, Any] | None = None,
                  gold_target: float | None = None) -> str:
    """results.json, table.md and curves.png in `out` (with `gold_target`, also each method's training time to
    reach that gold accuracy, and gold_vs_time.png); returns the markdown table."""
    summary = summarise(runs, gold_target)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"setting": setting, **(extra or {}), "gold_target": gold_target,
                                                  "summary": summary, "runs": runs}, indent=1))
    table = markdown_table(summary, runs[0]["evals"][0], setting, gold_target)
    (out / "table.md").write_text(table)
    plot(runs, out / "curves.png")
    if gold_target is not None:
        plot_gold_vs_time(runs, gold_target, out / "gold_vs_time.png")
    return table


def training_seconds(run: dict[str, Any], step: int) -> float:
    """The run's summed step times (rollout, reward, update, sync: `timing_s/step`) through `step`; evaluations
    and checkpoints are not counted."""
    return sum(row["step_s"] for row in run["rows"] if row["step"] <= step)


def time_to_gold(run: dict[str, Any], target: float) -> tuple[float, int] | None:
    """(training seconds, step) at the first evaluation after step 0 whose gold accuracy is >= `target`; None if
    none is (the resolution is the run's eval_every)."""
    for e in run["evals"]:
        if e["step"] > 0 and e.get("held_out", 0.0) >= target:
            return training_seconds(run, e["step"]), e["step"]
    return None


def summarise(runs: list[dict[str, Any]], gold_target: float | None = None) -> dict[str, dict[str, Any]]:
    """Per method: final eval (mean, std over seeds) and change from the base model (step-0 eval); with
    `gold_target`, the seeds that reached it and their mean training seconds and steps to it."""
    keys = ("held_out", "proxy_mean", "diversity_nn", "diversity_pairwise")
    out: dict[str, dict[str, Any]] = {}
    for method in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == method]
        entry: dict[str, Any] = {"seeds": len(mine)}
        for k in keys:
            final = [r["evals"][-1][k] for r in mine]
            delta = [r["evals"][-1][k] - r["evals"][0][k] for r in mine]
            entry[k] = (statistics.mean(final), statistics.pstdev(final))
            entry[f"delta_{k}"] = (statistics.mean(delta), statistics.pstdev(delta))
        entry["ratio_std"] = statistics.mean(statistics.mean(row.get("policy/ratio_std", 0.0) for row in r["rows"])
                                             for r in mine)
        entry["ratio_max"] = max(max(row.get("policy/ratio_max", 0.0) for row in r["rows"]) for r in mine)
        entry["step_s"] = statistics.mean(statistics.mean(row["step_s"] for row in r["rows"]) for r in mine)
        if gold_target is not None:
            reached = [t for t in (time_to_gold(r, gold_target) for r in mine) if t is not None]
            entry["gold_target"] = {"reached": len(reached), "of": len(mine),
                                    "seconds": statistics.mean(t[0] for t in reached) if reached else None,
                                    "steps": statistics.mean(t[1] for t in reached) if reached else None}
        out[method] = entry
    return out


def markdown_table(summary: dict[str, dict[str, Any]], base: dict[str, float], setting: str,
                   gold_target: float | None = None) -> str:
    def pm(v: tuple[float, float], pct: bool = False) -> str:
        return f"{v[0]:.1%} ± {v[1]:.1%}" if pct else f"{v[0]:.3f} ± {v[1]:.3f}"

    def delta(v: tuple[float, float], pct: bool = False) -> str:
        return f"{v[0]:+.1%}" if pct else f"{v[0]:+.2f}"

    lines = [f"Setting: {setting}", "",
             f"Base model: gold {base['held_out']:.1%}, proxy {base['proxy_mean']:.3f}, "
             f"diversity nn {base['diversity_nn']:.2f}, pairwise {base['diversity_pairwise']:.2f}", "",
             "| method | gold acc. (Δ) | proxy (Δ) | diversity nn (Δ) | diversity pairwise (Δ) | mean ratio std "
             "| max ratio | s/step |",
             "|---|---|---|---|---|---|---|---|"]
    for m, e in summary.items():
        lines.append(
            f"| {m} | {pm(e['held_out'], True)} ({delta(e['delta_held_out'], True)}) "
            f"| {pm(e['proxy_mean'])} ({delta(e['delta_proxy_mean'])}) "
            f"| {pm(e['diversity_nn'])} ({delta(e['delta_diversity_nn'])}) "
            f"| {pm(e['diversity_pairwise'])} ({delta(e['delta_diversity_pairwise'])}) "
            f"| {e['ratio_std']:.2e} | {e['ratio_max']:.3f} | {e['step_s']:.2f} |")
    if gold_target is not None:
        lines += ["", f"Training time to gold accuracy >= {gold_target:.0%} (summed step times, evaluations not "
                  "counted; mean over the seeds that reached it, at the first evaluation that did):", "",
                  "| method | seeds reached | training s | steps |", "|---|---|---|---|"]
        for m, e in summary.items():
            t = e["gold_target"]
            time_s, steps = (f"{t['seconds']:.0f}", f"{t['steps']:.1f}") if t["reached"] else ("—", "—")
            lines.append(f"| {m} | {t['reached']}/{t['of']} | {time_s} | {steps} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [("proxy", "proxy reward (train batch)"), ("held_out", "gold accuracy (train batch)"),
              ("diversity_nn", "diversity: nearest-neighbour"), ("diversity_pairwise", "diversity: pairwise")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for i, method in enumerate(dict.fromkeys(r["method"] for r in runs)):
        mine = [r for r in runs if r["method"] == method]
        steps = [row["step"] for row in mine[0]["rows"]]
        for ax, (key, title) in zip(axes, panels):
            vals = np.array([[row[key] for row in r["rows"]] for r in mine])
            kernel = np.ones(5) / 5  # 5-step moving average, edges kept
            smooth = np.array([np.convolve(np.pad(v, 2, mode="edge"), kernel, "valid") for v in vals])
            mean, lo, hi = smooth.mean(0), smooth.min(0), smooth.max(0)
            ax.plot(steps, mean, label=method, color=f"C{i}")
            ax.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.15)
            ax.set_title(title, fontsize=9)
    for ax in axes:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("hacking benchmark: mean over seeds (5-step moving average), band = min..max over seeds", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_gold_vs_time(runs: list[dict[str, Any]], target: float, path: Path) -> None:
    """Gold accuracy at each evaluation against the training seconds spent to reach it, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for i, method in enumerate(dict.fromkeys(r["method"] for r in runs)):
        for j, r in enumerate(x for x in runs if x["method"] == method):
            evals = [e for e in r["evals"] if "held_out" in e]
            ax.plot([training_seconds(r, e["step"]) for e in evals], [e["held_out"] for e in evals], color=f"C{i}",
                    marker=".", alpha=0.8, label=method if j == 0 else None)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    ax.set_xlabel("training seconds (summed step times)")
    ax.set_ylabel("gold accuracy (eval)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
