"""Ray's worker niceness under a competing CPU load: the default job's step on the Ray runtime, side by side.

    python benchmarks/worker_niceness.py [--repeats 3] [--steps 6] [--load 2]
                                         [--out benchmarks/results/worker_niceness.json]

Ray starts its workers (rollout and learner actors, Serve replicas) at the driver's niceness + 15 unless told
otherwise (`ray.worker_niceness`); the driver, which only waits on them, keeps its own. Conditions, alternated in
each repeat: quiet machine at niceness 15 and 0, then `--load` busy Python processes (started and killed by this
script, at its own niceness: the driver's) at worker niceness 15 and 0. Each run is
`python -m steadyrl.services.driver.job configs/digits-grpo.yaml run.runtime=ray ray.worker_niceness=N` in its own
process (benchmarks/services_overhead.py's `run_job`, default threads), first step dropped. Figures: each repeat's
ratios of the median step, load@15 / load@0, load@0 / quiet@0 and quiet@15 / quiet@0; their medians and min..max.
A run that fails (a starved Serve proxy killed by its health check, a raylet that misses its start-up window) is
recorded with its error and counted in `failed_runs`.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.figures import spread, write_json  # noqa: E402
from benchmarks.services_overhead import run_job  # noqa: E402

CONDITIONS = (("quiet", 15), ("quiet", 0), ("load", 15), ("load", 0))
RATIOS = {"load15_over_load0": (("load", 15), ("load", 0)), "load0_over_quiet0": (("load", 0), ("quiet", 0)),
          "quiet15_over_quiet0": (("quiet", 15), ("quiet", 0))}


@contextmanager
def busy_processes(n: int) -> Iterator[None]:
    """`n` CPU-bound Python processes at this process's niceness, killed on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def spread_or_none(values: list[float | None]) -> dict[str, float] | None:
    """Median and min..max of the runs that finished (None: none did)."""
    done = [v for v in values if v is not None]
    return {**spread(done), "runs": len(done)} if done else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="steps per run; the first is warm-up")
    ap.add_argument("--load", type=int, default=os.cpu_count() or 2, help="busy processes (default: one per core)")
    ap.add_argument("--out", default="benchmarks/results/worker_niceness.json")
    args = ap.parse_args()
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for load, niceness in CONDITIONS:
            with busy_processes(args.load if load == "load" else 0):
                try:
                    run = run_job("ray", args.steps, [f"ray.worker_niceness={niceness}"])
                except RuntimeError as err:  # a starved Serve proxy or raylet can fail the run: that is a result
                    run = {"runtime": "ray", "step_s_median": None, "error": str(err).strip().splitlines()[-8:]}
            run.update(repeat=repeat, load=load, worker_niceness=niceness)
            runs.append(run)
            step_s = run["step_s_median"]
            print(f"repeat {repeat} {load}@{niceness}: " + ("failed" if step_s is None else f"step {step_s:.2f}s"),
                  flush=True)

    def step(repeat: int, cond: tuple[str, int]) -> float | None:
        return next(r["step_s_median"] for r in runs if r["repeat"] == repeat and (r["load"], r["worker_niceness"])
                    == cond)

    ratios = {name: [step(i, a) / step(i, b) for i in range(args.repeats) if step(i, a) and step(i, b)]
              for name, (a, b) in RATIOS.items()}
    result = {
        "config": "configs/digits-grpo.yaml", "runtime": "ray", "steps": args.steps, "repeats": args.repeats,
        "cores": os.cpu_count(), "load_processes": args.load, "driver_niceness": os.getpriority(os.PRIO_PROCESS, 0),
        "step_s": {f"{load}@{n}": spread_or_none([r["step_s_median"] for r in runs
                                                   if (r["load"], r["worker_niceness"]) == (load, n)])
                   for load, n in CONDITIONS},
        "failed_runs": {f"{load}@{n}": sum(r["step_s_median"] is None for r in runs
                                           if (r["load"], r["worker_niceness"]) == (load, n))
                        for load, n in CONDITIONS},
        "ratios": {name: {"per_repeat": v, **(spread(v) if v else {})} for name, v in ratios.items()},
        "runs": runs,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
