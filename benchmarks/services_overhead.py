"""Services over one process: the default job on the Ray runtime against the local runtime, side by side.

    python benchmarks/services_overhead.py [--repeats 3] [--steps 8] [--warmup 1] [--out ...] [key=value ...]

Runs alternate (ray, local, ray, local, ...), `--repeats` pairs of `--steps` steps of configs/digits-grpo.yaml,
each `python -m steadyrl.services.driver.job` (the CLI) in its own process with the product's default threads
(`ray.torch_threads` None: every core in each actor, and in the local process, since the default loop does not
pipeline; `key=value` overrides apply to both runtimes). The first `--warmup` steps of each run are dropped (Ray's
and Serve's own start-up work runs into the first steps). Per run: the median step and its breakdown

    other = step - rollout - reward - update - sync

(rollout, reward: the rollout worker's `timing_s/rollout`, `timing_s/reward`; update: the learner's
`timing_s/update`; sync: the controller's `timing_s/sync`). `other` is what the services add: on Ray, Ray's
scheduling, object-store serialisation and the HTTP calls to Serve; on local it should be ~0. Start-up is process
start to the first step's start (imports, Ray and Serve or none, the reward models, the step-0 evaluation, which
both runtimes run alike). Also per run: the CPU seconds each kind of process spent over the measured steps
(`cpu_s_measured_steps`, psutil over the job's process tree), how many processes it had, and the peak of their
summed PSS. Figure: each pair's ratio ray/local of the median step, their median and min..max.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import spread, write_json  # noqa: E402
from memory import children, proc_kb  # noqa: E402 - benchmarks/memory.py's /proc readers
CONFIG = "configs/digits-grpo.yaml"
PHASES = ("rollout", "reward", "update", "sync")
TARGET = 1.10


def run_job(runtime: str, steps: int, overrides: list[str] = (), config: str = CONFIG, warmup: int = 1,
            env: dict[str, str] | None = None) -> dict[str, Any]:
    """One run of the CLI in a child process; its per-step timings from metrics.jsonl and its start-up
    (process start to the first step's start: the first row's arrival less that step's `timing_s/step`)."""
    from steadyrl.services.run_folder.metrics import read_metrics

    with tempfile.TemporaryDirectory(prefix="steadyrl-overhead-") as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "steadyrl.services.driver.job", config, f"run.runtime={runtime}",
               f"run.steps={steps}", f"run.run_dir={run_dir}", "run.progress=false", f"run.eval_every={steps}",
               f"run.checkpoint_every={steps}", "serve.port=0", *overrides]
        log = open(Path(tmp) / "job.log", "w")
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        first_row_at, cpu, cpu_at_row = None, {}, {}  # CPU readings as each step's row arrives
        pss_peak_kb, polls = 0, 0
        while proc.poll() is None:
            cpu = process_tree_cpu(proc.pid, cpu)
            rows_now = count_lines(run_dir / "metrics.jsonl")
            if rows_now and first_row_at is None:
                first_row_at = time.perf_counter() - t0
            cpu_at_row.setdefault(rows_now, dict(cpu))
            if rows_now and polls % 20 == 0:  # once a second while steps run: the run's processes' summed PSS
                pss_peak_kb = max(pss_peak_kb, tree_pss_kb(proc.pid))
            polls += 1
            time.sleep(0.05)
        wall = time.perf_counter() - t0
        log.close()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                               + (Path(tmp) / "job.log").read_text()[-3000:])
        rows = read_metrics(run_dir)
    if len(rows) <= warmup:
        raise ValueError(f"--steps {steps}: need more than the {warmup} warm-up step(s)")
    measured = rows[warmup:]
    step = [r["timing_s/step"] for r in measured]
    phase = {p: [r[f"timing_s/{p}"] for r in measured] for p in PHASES}
    other = [s - sum(phase[p][i] for p in PHASES) for i, s in enumerate(step)]
    return {
        "runtime": runtime,
        "overrides": list(overrides),
        "step_s": step,
        "step_s_median": statistics.median(step),
        "phase_s_median": {**{p: statistics.median(v) for p, v in phase.items()}, "other": statistics.median(other)},
        "startup_s": None if first_row_at is None else first_row_at - rows[0]["timing_s/step"],
        "wall_s": wall,
        "wall_minus_steps_s": wall - sum(r["timing_s/step"] for r in rows),
        # steps 1 .. steps - 2: the final step runs the last evaluation and checkpoint
        "cpu_s_measured_steps": cpu_by_role(cpu_at_row.get(steps - 1, {}), cpu_at_row.get(warmup, {})),
        "cpu_window_steps": steps - 1 - warmup,
        "processes": len(cpu),
        "pss_peak_mb": pss_peak_kb / 1024,
    }


def tree_pss_kb(root: int) -> int:
    """Summed proportional set size (/proc/PID/smaps_rollup: each shared page split between the processes that
    map it) of `root` and its descendants."""
    return sum((proc_kb(pid, ("Pss",), "smaps_rollup") or {}).get("Pss", 0) for pid in {root, *children(root)})


def count_lines(path: Path) -> int:
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def process_tree_cpu(root: int, last: dict[int, tuple[str, float]]) -> dict[int, tuple[str, float]]:
    """{pid: (process title, user + system CPU seconds)} of `root` and its descendants, keeping the last reading of
    processes that have exited."""
    import psutil

    seen = dict(last)
    try:
        procs = [psutil.Process(root), *psutil.Process(root).children(recursive=True)]
    except psutil.NoSuchProcess:
        return seen
    for p in procs:
        try:
            t = p.cpu_times()
            seen[p.pid] = (" ".join(p.cmdline())[:80] or p.name(), t.user + t.system)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return seen


def cpu_by_role(end: dict[int, tuple[str, float]], start: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each kind of process spent between two readings, summed over processes of one kind."""
    totals: dict[str, float] = {}
    for pid, (title, seconds) in end.items():
        role = title.split()[0].removeprefix("ray::").split(".")[0] if title.startswith("ray::") else \
            Path(title.split()[0]).name + (" -m " + title.split()[2] if " -m " in title else "")
        totals[role] = totals.get(role, 0.0) + seconds - start.get(pid, (title, 0.0))[1]
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def plot(runs: list[dict[str, Any]], path: Path, title: str) -> None:
    """Stacked bars of the median breakdown per runtime (median over its runs of each run's median)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(dict.fromkeys(r["runtime"] for r in runs))
    fig, ax = plt.subplots(figsize=(5, 4))
    for i, label in enumerate(labels):
        mine = [r for r in runs if r["runtime"] == label]
        bottom = 0.0
        for j, p in enumerate((*PHASES, "other")):
            v = max(0.0, statistics.median(r["phase_s_median"][p] for r in mine))
            ax.bar(i, v, bottom=bottom, color=f"C{j}", label=p if i == 0 else None)
            bottom += v
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("seconds per step (median)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="(ray, local) pairs")
    ap.add_argument("--steps", type=int, default=8, help="steps per run; the first is warm-up")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run left out")
    ap.add_argument("--out", default="benchmarks/results/services_overhead.json")
    ap.add_argument("overrides", nargs="*", help="key=value for both runtimes, e.g. ray.torch_threads=1")
    args = ap.parse_args()
    runs: list[dict[str, Any]] = []
    ratios: list[float] = []
    for pair in range(args.repeats):
        ray_run, local_run = (run_job(rt, args.steps, args.overrides, warmup=args.warmup) for rt in ("ray", "local"))
        for r in (ray_run, local_run):
            r["pair"] = pair
            runs.append(r)
        ratios.append(ray_run["step_s_median"] / local_run["step_s_median"])
        print(f"pair {pair}: ray {ray_run['step_s_median']:.2f}s local {local_run['step_s_median']:.2f}s "
              f"ratio {ratios[-1]:.3f}", flush=True)
    by = {rt: [r for r in runs if r["runtime"] == rt] for rt in ("ray", "local")}
    result = {
        "config": CONFIG, "overrides": args.overrides, "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats, "cores": os.cpu_count(),
        "torch_threads": next((o.split("=")[1] for o in args.overrides if o.startswith("ray.torch_threads=")),
                              "product default (ray.torch_threads None: every core per actor / in the local process)"),
        "ratio_ray_over_local": ratios, "ratio": spread(ratios), "target": TARGET,
        "meets_target": statistics.median(ratios) <= TARGET,
        "startup_s": {rt: spread([r["startup_s"] for r in rs if r["startup_s"] is not None]) for rt, rs in by.items()},
        "other_s": {rt: spread([r["phase_s_median"]["other"] for r in rs]) for rt, rs in by.items()},
        "runs": runs,
    }
    out = write_json(result, args.out)
    plot(runs, out.with_suffix(".png"), f"digits-grpo {' '.join(args.overrides)}, {args.steps - args.warmup} "
         f"steps x {args.repeats} pairs: ray/local "
         f"{result['ratio']['median']:.2f}x ({result['ratio']['min']:.2f}..{result['ratio']['max']:.2f})")


if __name__ == "__main__":
    main()
