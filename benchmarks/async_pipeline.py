"""Synchronous vs one-step-off-policy (async) loop on the default config, side by side in one process.

    python benchmarks/async_pipeline.py [--steps 60] [--config configs/digits-grpo.yaml] [--threads N]
                                        [--out benchmarks/results/async_pipeline]

Runs the same config twice through the real services (local Ray, the Serve ensemble, the DeepSpeed learner),
once with learner.max_staleness=0 and once with 1, same seed, and writes `<out>.json` (steps/s over the
steady-state steps, i.e. without the first step and without the evaluation/checkpoint steps, their ratio, and
the per-phase times) and `<out>.png` (training reward per step and held-out accuracy at each evaluation, both
modes). `--threads` sets ray.torch_threads for both (default: the config's; on a 2-core machine rollout and
learner then share the cores while they overlap).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from steadyrl.services.driver.controller import train  # noqa: E402
from steadyrl.services.run_folder.metrics import read_metrics  # noqa: E402

MODES = {"sync": 0, "async": 1}
PHASES = ("rollout", "reward", "update", "sync")


def steady(rows: list[dict], every: int) -> list[dict]:
    """Rows of steps that neither warm up (step 1) nor evaluate or checkpoint (their extra work is not the loop's)."""
    return [r for r in rows if r["step"] > 1 and r["step"] % every and r["step"] != rows[-1]["step"]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--config", default=None, help="default: configs/digits-grpo.yaml")
    ap.add_argument("--threads", type=int, default=None, help="ray.torch_threads for both runs")
    ap.add_argument("--out", default="benchmarks/results/async_pipeline")
    args = ap.parse_args()
    every = 20
    result: dict = {"config": args.config or "configs/digits-grpo.yaml", "steps": args.steps,
                    "torch_threads": args.threads, "modes": {}}
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode, staleness in MODES.items():
            overrides = [f"run.steps={args.steps}", f"run.run_dir={tmp}/{mode}", "run.progress=false",
                         f"run.eval_every={every}", f"run.checkpoint_every={every}", "serve.port=0",
                         f"learner.max_staleness={staleness}"]
            if args.threads:
                overrides.append(f"ray.torch_threads={args.threads}")
            run = train(args.config, overrides)
            rows = read_metrics(run.run_dir)
            body = steady(rows, every)
            step_s = statistics.mean(r["timing_s/step"] for r in body)
            result["modes"][mode] = {
                "learner.max_staleness": staleness,
                "steady_steps": len(body),
                "step_s": step_s,
                "steps_per_s": 1 / step_s,
                "phase_s": {p: statistics.mean(r[f"timing_s/{p}"] for r in body) for p in PHASES},
                "held_out": {str(e["step"]): e["held_out"] for e in json.loads(
                    (run.run_dir / "evals.json").read_text())},
                "train_reward_last10": statistics.mean(r["reward/train_mean"] for r in rows[-10:]),
            }
            curves[mode] = ([r["step"] for r in rows], [r["reward/train_mean"] for r in rows],
                            result["modes"][mode]["held_out"])
    result["async_over_sync_steps_per_s"] = (result["modes"]["async"]["steps_per_s"]
                                             / result["modes"]["sync"]["steps_per_s"])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.8))
    for mode, (steps, reward, gold) in curves.items():
        ax1.plot(steps, reward, label=f"{mode} ({result['modes'][mode]['steps_per_s']:.2f} steps/s)")
        ax2.plot([int(s) for s in gold], list(gold.values()), marker="o", label=mode)
    ax1.set(xlabel="step", ylabel="training reward (proxy, batch mean)", title="learning curve")
    ax2.set(xlabel="step", ylabel="held-out gold accuracy", title="evaluation")
    for ax in (ax1, ax2):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(f"sync vs one-step-off-policy: async/sync step rate = {result['async_over_sync_steps_per_s']:.2f}")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=120)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
