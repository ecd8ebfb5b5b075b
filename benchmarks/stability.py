"""StableDRL's stability claim on the arith testbed: collapses, gradient-norm spikes and NaNs per method.

Methods (their arith presets): grpo, stabledrl.paper, stabledrl.code, bgpo.paper, grpo.d1 (d1's token-level
GRPO, the form the dLLM papers' GRPO collapse claims are about). Settings:

  (a) noisy ratio   the new and old likelihoods use independent MC masks and n = 1 (StableDRL's target:
                    log rho is then noise even on policy -- see benchmarks/estimator_variance.py)
  (b) default       each preset as shipped
  (c) many passes   inner_epochs 4 over optimisation steps of 32 samples: 16 optimiser steps per batch,
                    the later ones far off policy

Counted per run (`steadyrl train --local`, the product loop in one process: benchmarks/compare.py):
  collapse  the final greedy exact match is more than `--collapse-drop` (absolute) below the base model's,
            i.e. it fell well below the start and did not recover (the run's minimum is reported too)
  spikes    optimiser updates whose pre-clip gradient norm exceeds 1e3 (policy/grad_norm, per RL step)
  nan       an update was not finite (the run's rows end there; counted as a collapse too)

    python benchmarks/stability.py            # ~40 min on 2 cores -> benchmarks/results/stability/
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

from benchmarks.compare import run_all  # noqa: E402

METHODS = {"grpo": "configs/arith-grpo.yaml", "stabledrl.paper": "configs/arith-stabledrl.yaml",
           "stabledrl.code": "configs/arith-stabledrl-code.yaml", "bgpo.paper": "configs/arith-bgpo.yaml",
           "grpo.d1": "configs/arith-grpo-d1.yaml"}
SETTINGS = {
    "a": ("noisy ratio: independent masks, n = 1", ["sampler.masks=independent", "sampler.mc_samples=1"]),
    "b": ("default presets", []),
    "c": ("many passes: 4 epochs x 4 optimiser steps per batch",
          ["learner.inner_epochs=4", "learner.micro_batch_size=32", "learner.optim_batch_size=64"]),
}
SPIKE = 1e3


def classify(run: dict[str, Any], drop: float) -> dict[str, Any]:
    base, final = run["evals"][0]["held_out"], run["evals"][-1]["held_out"]
    norms = [row.get("policy/grad_norm", 0.0) for row in run["rows"]]
    nan = run.get("stopped_at") is not None or any(n != n for n in norms)
    return {"base": base, "final": final, "min": min(e["held_out"] for e in run["evals"]),
            "collapse": nan or final < base - drop, "spikes": sum(n > SPIKE for n in norms), "nan": nan,
            "max_grad_norm": max(norms)}


def summarise(runs: list[dict[str, Any]], drop: float) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for key in dict.fromkeys(r["method"] for r in runs):
        cls = [classify(r, drop) for r in runs if r["method"] == key]
        finals = [c["final"] for c in cls]
        out[key] = {"seeds": len(cls), "collapses": sum(c["collapse"] for c in cls),
                    "spikes": sum(c["spikes"] for c in cls), "nan_runs": sum(c["nan"] for c in cls),
                    "base": cls[0]["base"], "final_mean": statistics.mean(finals),
                    "final_std": statistics.pstdev(finals), "min_eval": min(c["min"] for c in cls),
                    "max_grad_norm": max(c["max_grad_norm"] for c in cls)}
    return out


def markdown(summary: dict[str, dict[str, Any]]) -> str:
    lines = ["| setting | method | collapses | grad-norm spikes (>1e3) | NaN runs | exact match: base -> final "
             "(mean ± std) | lowest eval | max grad norm |", "|---|---|---|---|---|---|---|---|"]
    for key, e in summary.items():
        setting, method = key.split(":", 1)
        lines.append(f"| ({setting}) | {method} | {e['collapses']}/{e['seeds']} | {e['spikes']} | {e['nan_runs']} | "
                     f"{e['base']:.1%} -> {e['final_mean']:.1%} ± {e['final_std']:.1%} | {e['min_eval']:.1%} | "
                     f"{e['max_grad_norm']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(runs: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(dict.fromkeys(r["method"].split(":")[0] for r in runs))
    fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.8), squeeze=False)
    for ax, setting in zip(axes[0], settings):
        for i, method in enumerate(METHODS):
            for j, r in enumerate(r for r in runs if r["method"] == f"{setting}:{method}"):
                ax.plot([e["step"] for e in r["evals"]], [e["held_out"] for e in r["evals"]], color=f"C{i}",
                        alpha=0.6, label=method if j == 0 else None)
        ax.set_title(f"({setting}) {SETTINGS[setting][0]}", fontsize=9)
        ax.set_xlabel("RL step")
        ax.set_ylabel("greedy exact match (200 held-out problems)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds-a", type=int, default=5)
    parser.add_argument("--seeds-bc", type=int, default=3)
    parser.add_argument("--settings", default="abc")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ", ".join(METHODS))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--collapse-drop", type=float, default=0.15)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "stability")
    args = parser.parse_args()
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        parser.error(f"--methods: unknown {sorted(unknown)}; known: {', '.join(METHODS)}")
    from benchmarks.compare import warm_caches
    from steadyrl.services.config import load_config

    warm_caches(load_config(ROOT / METHODS["grpo"]))
    common = [f"run.steps={args.steps}"]
    t0 = time.perf_counter()
    runs: list[dict[str, Any]] = []
    for setting in args.settings:
        seeds = list(range(args.seeds_a if setting == "a" else args.seeds_bc))
        variants = [(f"{setting}:{m}", preset, common + SETTINGS[setting][1]) for m, preset in METHODS.items()
                    if m in args.methods.split(",")]
        runs += run_all(variants, seeds, args.jobs, args.eval_every)
    summary = summarise(runs, args.collapse_drop)
    args.out.mkdir(parents=True, exist_ok=True)
    md = markdown(summary)
    (args.out / "table.md").write_text(md)
    (args.out / "results.json").write_text(json.dumps({
        "command": "python benchmarks/stability.py " + " ".join(sys.argv[1:]), "wall_s": time.perf_counter() - t0,
        "settings": {k: {"label": v[0], "overrides": v[1]} for k, v in SETTINGS.items()},
        "collapse_drop": args.collapse_drop, "spike_threshold": SPIKE, "summary": summary, "runs": runs}, indent=1))
    plot(runs, args.out / "curves.png")
    print(md)
    print(f"wrote {args.out} in {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
