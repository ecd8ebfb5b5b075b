"""Collapse rollback (`health.rollback`) on the setting that collapses: StableDRL with many optimiser steps per
batch on the arith testbed (the stability benchmark's setting (c): 4 epochs x 4 optimiser steps of 64 samples, 16
steps per batch, where both StableDRL forms collapsed in 3/3 seeds), each run with and without rollback.

Counted per run (`steadyrl train --local`, the product loop: benchmarks/compare.py):
  collapse   the final greedy exact match is more than `--collapse-drop` below the base model's (the stability
             benchmark's rule)
  rollbacks  how many times the run restored a checkpoint (rollbacks.jsonl), and the RL steps they redid
  wall_s     the run's wall time (a rollback redoes steps: its cost)

    python benchmarks/rollback.py          # ~15 min on 2 cores -> benchmarks/results/rollback/
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import run_all, warm_caches  # noqa: E402

METHODS = {"stabledrl.paper": "configs/arith-stabledrl.yaml", "stabledrl.code": "configs/arith-stabledrl-code.yaml"}
MANY_STEPS = ["learner.inner_epochs=4", "learner.micro_batch_size=32", "learner.optim_batch_size=64"]
ROLLBACK = ["health.rollback.enabled=true"]


def classify(run: dict[str, Any], drop: float) -> dict[str, Any]:
    base, final = run["evals"][0]["held_out"], run["evals"][-1]["held_out"]
    return {"base": base, "final": final, "min": min(e["held_out"] for e in run["evals"]),
            "collapse": run.get("stopped_at") is not None or final < base - drop, "rollbacks": len(run["rollbacks"]),
            "redone_steps": sum(r["step"] - r["restored_step"] for r in run["rollbacks"]), "wall_s": run["wall_s"]}


def summarise(runs: list[dict[str, Any]], drop: float) -> dict[str, dict[str, Any]]:
    out = {}
    for key in dict.fromkeys(r["method"] for r in runs):
        cls = [classify(r, drop) for r in runs if r["method"] == key]
        finals = [c["final"] for c in cls]
        out[key] = {"seeds": len(cls), "collapses": sum(c["collapse"] for c in cls), "base": cls[0]["base"],
                    "final_mean": statistics.mean(finals), "final_std": statistics.pstdev(finals),
                    "finals": finals, "min_eval": min(c["min"] for c in cls),
                    "rollbacks": [c["rollbacks"] for c in cls], "redone_steps": [c["redone_steps"] for c in cls],
                    "wall_s_median": statistics.median(c["wall_s"] for c in cls)}
    return out


def markdown(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| method | rollback | collapses | exact match: base -> final (mean ± std) | finals | lowest eval | "
             "rollbacks per seed | steps redone per seed | wall s (median) |", "|---|---|---|---|---|---|---|---|---|"]
    for key, e in summary.items():
        method, mode = key.split(":")
        lines.append(f"| {method} | {mode} | {e['collapses']}/{e['seeds']} | {e['base']:.1%} -> {e['final_mean']:.1%} "
                     f"± {e['final_std']:.1%} | {', '.join(f'{f:.1%}' for f in e['finals'])} | {e['min_eval']:.1%} | "
                     f"{', '.join(map(str, e['rollbacks']))} | {', '.join(map(str, e['redone_steps']))} | "
                     f"{e['wall_s_median']:.0f} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(METHODS), figsize=(5 * len(METHODS), 3.8), squeeze=False)
    for ax, method in zip(axes[0], METHODS):
        for i, mode in enumerate(("off", "on")):
            for j, r in enumerate(r for r in runs if r["method"] == f"{method}:{mode}"):
                ax.plot([e["step"] for e in r["evals"]], [e["held_out"] for e in r["evals"]], "o-", color=f"C{i}",
                        alpha=0.7, label=f"rollback {mode}" if j == 0 else None)
        ax.set_title(f"{method}, 16 optimiser steps per batch", fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylabel("greedy exact match (held-out)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--collapse-drop", type=float, default=0.15)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rollback")
    args = parser.parse_args()
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; known: {', '.join(METHODS)}")
    from steadyrl.services.config import load_config

    warm_caches(load_config(ROOT / METHODS["stabledrl.paper"]))
    t0 = time.perf_counter()
    common = [f"run.steps={args.steps}", *MANY_STEPS]
    variants = [(f"{m}:{mode}", preset, common + (ROLLBACK if mode == "on" else []))
                for m, preset in METHODS.items() if m in args.methods.split(",") for mode in ("off", "on")]
    runs = run_all(variants, list(range(args.seeds)), args.jobs, args.eval_every)
    summary = summarise(runs, args.collapse_drop)
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(summary)
    (args.out / "table.md").write_text(md)
    (args.out / "results.json").write_text(json.dumps({
        "command": "python benchmarks/rollback.py " + " ".join(sys.argv[1:]), "wall_s": time.perf_counter() - t0,
        "overrides": {"many_steps": MANY_STEPS, "rollback": ROLLBACK}, "collapse_drop": args.collapse_drop,
        "summary": summary, "runs": runs}, indent=1))
    plot(runs, args.out / "curves.png")
    print(md)


if __name__ == "__main__":
    main()
