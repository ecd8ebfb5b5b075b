"""Reward models in their own Serve replicas or in the ensemble's: the default job on Ray with each layout, and on
the local runtime, side by side.

    python benchmarks/colocated_rewards.py [--repeats 3] [--steps 14] [--warmup 5]
        -> benchmarks/results/colocated_rewards.json

Runs rotate (per-model, colocated, local, then the next repeat starting one further on), each
`python -m steadyrl.services.driver.job configs/digits-grpo.yaml` in a fresh process with the product's default threads
(`benchmarks/services_overhead.run_job`). `per-model` is `serve.colocate_models=false` (one Serve replica per
reward model plus the ensemble's: 5), `colocated` is `true` (the ensemble's replica hosts the 4 models). The first
`--warmup` steps are dropped (Ray's and Serve's start-up work runs into the first steps). Per run: the median step
and its phases, the CPU seconds each kind of process spent over the measured steps, how many processes the run
had, and the peak of their summed PSS (each shared page split between the processes mapping it). Figures:
per-model / local and colocated / local of the median step, per repeat, median with min..max.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import spread, write_json  # noqa: E402
from services_overhead import run_job  # noqa: E402

VARIANTS = {"per-model": ("ray", ["serve.colocate_models=false"]),
            "colocated": ("ray", ["serve.colocate_models=true"]),
            "local": ("local", [])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=5, help="first steps of each run left out")
    ap.add_argument("--out", default="benchmarks/results/colocated_rewards.json")
    args = ap.parse_args()
    names = list(VARIANTS)
    runs: list[dict[str, Any]] = []
    for r in range(args.repeats):
        for name in names[r % 3:] + names[:r % 3]:
            runtime, overrides = VARIANTS[name]
            run = run_job(runtime, args.steps, overrides, warmup=args.warmup)
            runs.append({**run, "variant": name, "repeat": r})
            print(f"repeat {r} {name}: step {run['step_s_median']:.2f}s update {run['phase_s_median']['update']:.2f}s "
                  f"processes {run['processes']} pss {run['pss_peak_mb']:.0f} MB", flush=True)

    def of(name: str, key: str) -> list[Any]:
        return [run[key] for run in sorted((x for x in runs if x["variant"] == name), key=lambda x: x["repeat"])]

    local = of("local", "step_s_median")
    result = {
        "config": "configs/digits-grpo.yaml", "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "step_s": {n: spread(of(n, "step_s_median")) for n in names},
        "update_s": {n: spread([x["update"] for x in of(n, "phase_s_median")]) for n in names},
        "over_local": {n: spread([a / b for a, b in zip(of(n, "step_s_median"), local)]) for n in names[:2]},
        "colocated_over_per_model": spread([a / b for a, b in zip(of("colocated", "step_s_median"),
                                                                  of("per-model", "step_s_median"))]),
        "processes": {n: statistics.median(of(n, "processes")) for n in names},
        "pss_peak_mb": {n: spread(of(n, "pss_peak_mb")) for n in names},
        "runs": runs,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
