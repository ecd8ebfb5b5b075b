"""Step-time split of the default loop (rollout / reward / update / sync), measured in one run.

    python benchmarks/step_time.py [--steps 10] [--out benchmarks/results/step_time.json]

Writes mean seconds per phase and each phase's share of the step (ratios measured side by side in
the same run), skipping the first step (warm-up).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from steadyrl.services.driver.controller import train
from steadyrl.services.run_folder.metrics import read_metrics

PHASES = ("rollout", "reward", "update", "sync")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--config", default=None)
    ap.add_argument("--out", default="benchmarks/results/step_time.json")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        train(args.config, [f"run.steps={args.steps}", f"run.run_dir={tmp}/run", "run.progress=false",
                            f"run.eval_every={args.steps}", f"run.checkpoint_every={args.steps}", "serve.port=0"])
        rows = read_metrics(Path(tmp) / "run")[1:]
    step = statistics.mean(r["timing_s/step"] for r in rows)
    result = {
        "steps_measured": len(rows),
        "step_s": step,
        "samples_per_s": statistics.mean(r["perf/samples_per_s"] for r in rows),
        "phase_s": {p: statistics.mean(r[f"timing_s/{p}"] for r in rows) for p in PHASES},
    }
    result["phase_share"] = {p: v / step for p, v in result["phase_s"].items()}
    result["other_share"] = 1 - sum(result["phase_share"].values())
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
