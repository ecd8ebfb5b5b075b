"""The near-deterministic step: does GRPO-Guard's re-weighting make `train_min_std` unnecessary?

    python benchmarks/near_deterministic_step.py [--steps 30] [--seeds 0 1 2] [--jobs 2]

The digits DDIM schedule's step t=100 -> 0 has std 0.006; its per-step score scales as 1/std, so
training it swamps the gradient, and the GRPO presets skip steps with std < 0.05. Same budget, same
seeds, the default (non-hackable) proxy:
  grpo, train_min_std=0      every stochastic step, as DDPO
  grpo, train_min_std=0.05   the presets' workaround
  grpo_guard.paper, train_min_std=0   RatioNorm + |dt| re-weighting on every stochastic step
Writes results.json, table.md and curves.png to --out (default benchmarks/results/near_deterministic_step).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.compare import preset, run_all, write_results  # noqa: E402

VARIANTS = [
    ("grpo, min_std 0", "grpo", ["objective.train_min_std=0"]),
    ("grpo, min_std 0.05", "grpo", ["objective.train_min_std=0.05"]),
    ("grpo_guard.paper, min_std 0", "grpo_guard.paper", ["objective.train_min_std=0"]),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--samples-per-class", type=int, default=8)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--eval-samples-per-class", type=int, default=30)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "near_deterministic_step")
    args = ap.parse_args()
    common = [f"run.steps={args.steps}", f"sampler.group_size={args.samples_per_class}",
              f"testbed.eval_samples_per_class={args.eval_samples_per_class}"]
    from benchmarks.compare import warm_caches
    from steadyrl.services.config import load_config

    warm_caches(load_config(preset("grpo"), common))
    t0 = time.perf_counter()
    runs = run_all([(label, method, common + extra) for label, method, extra in VARIANTS], args.seeds, args.jobs,
                   args.eval_every)
    setting = (f"default proxy (cnn), DDIM 10 steps, {args.steps} steps, {args.samples_per_class} samples per class, "
               f"seeds {args.seeds}; wall {time.perf_counter() - t0:.0f} s with {args.jobs} jobs")
    print(write_results(runs, setting, args.out))


if __name__ == "__main__":
    main()
