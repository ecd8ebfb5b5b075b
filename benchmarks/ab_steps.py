"""Two settings of one preset side by side: the step's phases with override set A against set B, alternated.

    python benchmarks/ab_steps.py configs/arith-grpo.yaml --a learner.old_logp=recompute --b learner.old_logp=auto \
        [--pairs 2] [--steps 12] [--out benchmarks/results/ab_arith_old_logp.json]

Each run is `steadyrl train --local` (the product loop in one process) in its own subprocess, A and B alternating
(A first in even pairs, B first in odd ones); per run the median over its steps after the first of each
`timing_s/*` phase; then per pair the ratio B / A of each, and their median and min..max. The runs' held-out
evaluations are kept too, so a change that should not alter learning can be seen not to.
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


def one_run(config: str, overrides: list[str], steps: int) -> dict:
    """Median seconds of each timing phase over steps 2..N of one `--local` run, and its evaluations."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "steadyrl.services.cli", "train", "--local", config, f"run.steps={steps}",
               f"run.eval_every={steps}", f"run.checkpoint_every={steps}", f"run.run_dir={run}", "run.progress=false",
               *overrides]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
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
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs: list[dict] = []
    for pair in range(args.pairs):
        order = [("a", args.a), ("b", args.b)] if pair % 2 == 0 else [("b", args.b), ("a", args.a)]
        for name, overrides in order:
            runs.append({"pair": pair, "setting": name, **one_run(args.config, overrides, args.steps)})
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
            ratios[phase] = {"median": statistics.median(per_pair), "min": min(per_pair), "max": max(per_pair),
                             "per_pair": per_pair}
    result = {"config": args.config, "a": args.a, "b": args.b, "steps": args.steps, "pairs": args.pairs,
              "ratio_b_over_a": ratios, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps(ratios, indent=2))


if __name__ == "__main__":
    main()
