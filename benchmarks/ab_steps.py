"""Two settings of one preset side by side: the step's phases with override set A against set B, alternated.

    python benchmarks/ab_steps.py configs/arith-grpo.yaml --a learner.old_logp=recompute --b learner.old_logp=auto \
        [--pairs 2] [--steps 12] [--runtime local] [--warmup 1] [--out benchmarks/results/ab_arith_old_logp.json]

Each run is `steadyrl train --local` (the product loop in one process; `--runtime ray`: `steadyrl train`, the
same loop over a local Ray and Serve) in its own subprocess, A and B alternating (A first in even pairs, B first
in odd ones); per run the median over its steps after the first `--warmup` of each `timing_s/*` phase; then per
pair the ratio B / A of each, and their median, its 95 % interval (`figures.median_interval`: min..max below 6
pairs) and min..max. The runs' held-out evaluations are kept too, so a change that should not alter learning can
be seen not to.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import median_interval, spread, write_json  # noqa: E402


def one_run(config: str, overrides: list[str], steps: int, runtime: str = "local", warmup: int = 1) -> dict:
    """Median seconds of each timing phase over the steps after the first `warmup` of one run, and its
    evaluations."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "steadyrl.services.driver.cli", "train", config, f"run.runtime={runtime}",
               f"run.steps={steps}", f"run.eval_every={steps}", f"run.checkpoint_every={steps}", f"run.run_dir={run}",
               "run.progress=false", "serve.port=0", *overrides]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][warmup:]
        evals = json.loads((run / "evals.json").read_text())
    phases = sorted({k for r in rows for k in r if k.startswith("timing_s/")})
    return {"overrides": overrides, "phase_s": {k: statistics.median(r[k] for r in rows if k in r) for k in phases},
            "held_out": [e["held_out"] for e in evals]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("config")
    ap.add_argument("--a", nargs="*", default=[], help="overrides of setting A")
    ap.add_argument("--b", nargs="*", default=[], help="overrides of setting B")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--runtime", choices=("local", "ray"), default="local",
                    help="ray: over a local Ray and Serve, whose start-up work runs into the first steps")
    ap.add_argument("--warmup", type=int, default=1, help="first steps of each run left out of its medians")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    runs: list[dict] = []
    for pair in range(args.pairs):
        order = [("a", args.a), ("b", args.b)] if pair % 2 == 0 else [("b", args.b), ("a", args.a)]
        for name, overrides in order:
            runs.append({"pair": pair, "setting": name, **one_run(args.config, overrides, args.steps, args.runtime,
                                                                        args.warmup)})
            print(f"pair {pair} {name}: " + "  ".join(f"{k.split('/')[1]} {v:.3f}s"
                                                       for k, v in runs[-1]["phase_s"].items()), flush=True)
    ratios: dict[str, dict] = {}
    for phase in runs[0]["phase_s"]:
        per_pair = []
        for pair in range(args.pairs):
            a, b = (next(r for r in runs if r["pair"] == pair and r["setting"] == s) for s in "ab")
            if phase in a["phase_s"] and phase in b["phase_s"] and a["phase_s"][phase] > 0:
                per_pair.append(b["phase_s"][phase] / a["phase_s"][phase])
        if per_pair:
            ratios[phase] = {**spread(per_pair), "median_ci95": median_interval(per_pair), "per_pair": per_pair}
    result = {"config": args.config, "runtime": args.runtime, "a": args.a, "b": args.b, "steps": args.steps,
              "warmup": args.warmup, "pairs": args.pairs,
              "ratio_b_over_a": ratios, "runs": runs}
    write_json(result, args.out)


if __name__ == "__main__":
    main()
