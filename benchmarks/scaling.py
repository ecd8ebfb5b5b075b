"""Scaling: rollout throughput with 1 vs 2 rollout actors and update time with 1 vs 2 learner ranks at equal total
threads, and a step-time model fitted to the measured phases (projected to an 8-GPU SD3.5-Medium run).

    python benchmarks/scaling.py [--pairs 2] [--steps 6] [--config configs/digits-grpo.yaml]
                                 [--out benchmarks/results/scaling.json]
    python benchmarks/scaling.py --model-only   # re-derive the model and projection from the JSON's measurements

Each pair runs the default job through Ray twice, alternated: `1x2` (1 rollout actor, 1 learner rank, 2 torch
threads each) and `2x1` (2 rollout actors, 2 learner ranks, 1 thread each): the same total threads on a 2-core
machine. The loop is synchronous (learner.max_staleness=0): rollout and update never overlap, so the rollout phase
compares 1 vs 2 actors and the update phase 1 vs 2 ranks in the same runs. Both use learner.optim_batch_size=64
(32 x 2 accumulated micro-batches on 1 rank, 32 per rank on 2): the same optimiser steps. Step 1 (warm-up) is
dropped; each run's figure is its mean over the other steps; the JSON has the median over pairs and min..max.
The model (`step_time`) and its fit and projection live in benchmarks/scaling_model.py.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from figures import spread  # noqa: E402 - benchmarks/figures.py
from scaling_model import model_section  # benchmarks/scaling_model.py: the step-time model and SD3.5 projection

VARIANTS = {"1x2": {"workers": 1, "ranks": 1, "threads": 2}, "2x1": {"workers": 2, "ranks": 2, "threads": 1}}
PHASES = ("rollout", "reward", "collect", "update", "sync", "step")


def run_variant(config: str | None, variant: dict[str, int], steps: int, run_dir: Path) -> dict[str, Any]:
    """One short run of the product loop through Ray; mean seconds per phase over steps 2..steps, samples per step."""
    from steadyrl.services.driver.controller import train
    from steadyrl.services.run_folder.metrics import read_metrics

    result = train(config, [
        f"run.steps={steps}", f"run.run_dir={run_dir}", "run.progress=false", f"run.eval_every={steps}",
        f"run.checkpoint_every={steps}", "serve.port=0", "ray.num_cpus=4", "learner.optim_batch_size=64",
        f"ray.rollout_workers={variant['workers']}", f"learner.ranks={variant['ranks']}",
        f"ray.torch_threads={variant['threads']}"])
    rows = read_metrics(result.run_dir)[1:]
    if not rows:
        raise ValueError(f"--steps={steps}: need at least 2 steps (the first is dropped)")
    out: dict[str, Any] = {f"{p}_s": statistics.mean(r[f"timing_s/{p}"] for r in rows) for p in PHASES}
    out["samples_per_step"] = statistics.mean(r["rollout/samples"] for r in rows)
    out["steps_measured"] = len(rows)
    # everything in the step that is none of the timed phases: Ray calls, object transfers, launch, the Serve hop
    out["sched_s"] = out["step_s"] - out["collect_s"] - out["update_s"] - out["sync_s"]
    out["rollout_samples_per_s"] = out["samples_per_step"] / out["rollout_s"]
    out["collect_samples_per_s"] = out["samples_per_step"] / out["collect_s"]
    return out


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per variant: median (min..max over pairs) of each figure; per pair: the 2x1/1x2 ratios, then their spread."""
    keys = [k for k in runs[0]["figures"] if k != "steps_measured"]
    per_variant = {v: {k: spread([r["figures"][k] for r in runs if r["variant"] == v]) for k in keys}
                   for v in VARIANTS}
    pairs = sorted({r["pair"] for r in runs})
    fig = {(r["pair"], r["variant"]): r["figures"] for r in runs}
    def ratio(key: str) -> list[float]:
        return [fig[p, "2x1"][key] / fig[p, "1x2"][key] for p in pairs]

    ratios = {"rollout_throughput_2x1_over_1x2": ratio("rollout_samples_per_s"),
              "collect_throughput_2x1_over_1x2": ratio("collect_samples_per_s"),
              "update_time_2x1_over_1x2": ratio("update_s"), "step_time_2x1_over_1x2": ratio("step_s")}
    return {"per_variant": per_variant, "ratios": {k: spread(v) | {"per_pair": v} for k, v in ratios.items()}}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = list(VARIANTS) if pair % 2 == 0 else list(VARIANTS)[::-1]  # alternate which goes first
            for name in order:
                figures = run_variant(args.config, VARIANTS[name], args.steps, Path(tmp) / f"{pair}-{name}")
                runs.append({"pair": pair, "variant": name, "figures": figures})
                print(json.dumps(runs[-1]), flush=True)
    return {"config": args.config or "configs/digits-grpo.yaml", "steps": args.steps, "pairs": args.pairs,
            "variants": VARIANTS, "runs": runs, **summarise(runs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--config", default=None, help="default: configs/digits-grpo.yaml")
    ap.add_argument("--out", default="benchmarks/results/scaling.json")
    ap.add_argument("--model-only", action="store_true", help="keep the JSON's measurements, redo the model")
    args = ap.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.model_only:
        result = json.loads(out.read_text())
    else:
        result = measure(args)
        out.write_text(json.dumps(result, indent=2))  # the measurements are kept even if the model below fails
    result["model"] = model_section(result)
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("ratios", "model")}, indent=2))


if __name__ == "__main__":
    main()
