"""Compiled against eager model passes, and the update's achieved FLOP/s against this machine's measured peak.

    python benchmarks/compile_update.py [--config configs/digits-grpo.yaml] [--steps 8] [--pairs 1]
        [--out benchmarks/results/compile_update.json]

1. peak: the best FLOP/s of a float32 matmul (n = 1024, 2048, 3072; 2 n^3 FLOPs each) on all of torch's threads:
   the machine's physical limit for dense float32 work.
2. the update's model pass: forward and backward of the preset's policy network on one micro-batch
   (learner.micro_batch_size samples at one timestep), eager and `torch.compile`d as `compile.update` compiles it;
   FLOPs counted by torch's FlopCounterMode (eager), seconds as the median of 5 after warm-up, the first
   compiled call's seconds reported apart as its compile time; achieved FLOP/s and its fraction of the peak.
3. the loop: `steadyrl train --local` of the preset for `--steps` steps, eager and with compile.rollout and
   compile.update (alternated `--pairs` times); per run the median over steps 2.. of timing_s/update,
   timing_s/rollout and timing_s/step, step 1's compile seconds apart, and the largest rollout-vs-recompute
   log-prob gap (the alarm fires past learner.logp_alarm).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from steadyrl.services.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import write_json  # noqa: E402


def matmul_peak(sizes: tuple[int, ...] = (1024, 2048, 3072), repeats: int = 5) -> dict:
    """Best float32 matmul FLOP/s over `sizes` (2 n^3 FLOPs per product)."""
    best = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
        best[n] = 2 * n ** 3 / min(times)
    return {"flops_per_s": max(best.values()), "by_size": {str(n): f for n, f in best.items()},
            "threads": torch.get_num_threads()}


def seconds(fn, repeats: int = 5) -> float:
    """Median seconds of `fn()` over `repeats` calls."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def model_pass(config: str, peak: float) -> dict:
    """Forward + backward of the preset's policy on one micro-batch, eager and compiled."""
    from safetensors.torch import load_file
    from torch.utils.flop_counter import FlopCounterMode

    from steadyrl.rollout.compile import CompileConfig, compile_network
    from steadyrl.services.config import load_config
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(ROOT / config)
    testbed = build_testbed(cfg)
    policy = testbed.build_policy(load_file(str(testbed.base_weights(progress=False)))).train()
    batch = testbed.sample(testbed.build_sampler(), policy.eval(), testbed.eval_prompts()[:1],
                           cfg.learner.micro_batch_size, torch.Generator().manual_seed(0))
    policy.train()
    sampler = testbed.build_sampler()
    step = int(sampler.train_steps(cfg.objective.train_min_std)[0])
    x, t, cond = batch.traj[:, step].contiguous(), sampler.timesteps[step], batch.cond  # traj [B, T+1, ...]

    def fwd_bwd() -> None:
        policy.zero_grad(set_to_none=True)
        policy(x, t, cond).float().square().mean().backward()

    with FlopCounterMode(display=False) as counter:
        fwd_bwd()
    flops = float(counter.get_total_flops())
    fwd_bwd()
    eager_s = seconds(fwd_bwd)
    compile_network(policy, CompileConfig(update=True))
    t0 = time.perf_counter()
    fwd_bwd()
    first_s = time.perf_counter() - t0
    fwd_bwd()
    compiled_s = seconds(fwd_bwd)
    n_trained = trained_steps_per_sample(cfg, sampler)
    prompts = len(testbed.train_prompts(0, 1, 0)[0])  # a step's prompts: each sampled group_size times
    per_update = prompts * cfg.sampler.group_size * n_trained * cfg.learner.inner_epochs  # forward+backward passes
    out = {"samples": len(x), "flops": flops, "trained_steps_per_sample": n_trained,
           "micro_batches_per_update": per_update / len(x)}
    for name, s in (("eager", eager_s), ("compiled", compiled_s)):
        out[name] = {"seconds": s, "flops_per_s": flops / s, "fraction_of_peak": flops / s / peak}
    out["compiled"]["first_call_s"] = first_s
    out["speedup"] = eager_s / compiled_s
    return out


def trained_steps_per_sample(cfg: TrainConfig, sampler: Any) -> int:
    """Denoising steps the update trains per sample: the sampler's steps with std >= train_min_std, within a training
    rollout's SDE window when there is one (as `Learner.batch_train_steps`), the objective's share of them
    (`trainer.terms.fraction_of_steps`)."""
    from steadyrl.trainer.terms import fraction_of_steps

    trainable = sampler.train_steps(cfg.objective.train_min_std)
    if getattr(sampler, "windowed", False):
        trainable = trainable[sampler.sde_steps(train_step=1)[trainable]]
    return fraction_of_steps(len(trainable), cfg.objective.timestep_fraction)


def train_run(config: str, steps: int, compiled: bool) -> dict:
    """`steadyrl train --local` for `steps` steps; medians over steps 2.. and step 1's compile seconds (from an
    empty inductor cache, as on a fresh machine)."""
    extra = ["compile.rollout=true", "compile.update=true"] if compiled else []
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(Path(tmp) / "inductor")}
        run = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "steadyrl.services.driver.cli", "train", config, "run.runtime=local",
               f"run.steps={steps}", f"run.eval_every={steps}", f"run.checkpoint_every={steps}",
               f"run.run_dir={run}", "run.progress=false", *extra]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-3000:]}")
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    later = rows[1:]
    out = {k: statistics.median(r[k] for r in later) for k in ("timing_s/update", "timing_s/rollout", "timing_s/step")}
    out["first_step_s"] = rows[0]["timing_s/step"]
    out["compile_s"] = rows[0].get("timing_s/update_compile", 0.0) + rows[0].get("timing_s/rollout_compile", 0.0)
    out["recompiles_after_step_1_s"] = sum(r.get("timing_s/update_compile", 0.0) + r.get("timing_s/rollout_compile",
                                                                                          0.0) for r in later)
    out["rollout_logp_absdiff_max"] = max(r["policy/rollout_logp_absdiff_max"] for r in rows)
    out["logp_alarms"] = sum(r["policy/rollout_logp_alarm"] for r in rows)
    out["reward_train_mean"] = [r["reward/train_mean"] for r in rows]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/digits-grpo.yaml")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--pairs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/compile_update.json"))
    args = ap.parse_args()
    # every compile from an empty inductor cache, as on a fresh machine (this process's and each run's own)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-")
    peak = matmul_peak()
    print(f"matmul peak {peak['flops_per_s'] / 1e9:.1f} GFLOP/s", flush=True)
    passes = model_pass(args.config, peak["flops_per_s"])
    print(f"model pass: eager {passes['eager']['seconds']:.3f} s, compiled {passes['compiled']['seconds']:.3f} s "
          f"(first call {passes['compiled']['first_call_s']:.1f} s)", flush=True)
    runs: dict[str, list[dict]] = {"eager": [], "compiled": []}
    for pair in range(args.pairs):
        for compiled in ((False, True) if pair % 2 == 0 else (True, False)):
            runs["compiled" if compiled else "eager"].append(train_run(args.config, args.steps, compiled))
            print(f"pair {pair}: {'compiled' if compiled else 'eager'} done", flush=True)
    ratio = {k: statistics.median(e[k] / c[k] for e, c in zip(runs["eager"], runs["compiled"]))
             for k in ("timing_s/update", "timing_s/rollout", "timing_s/step")}
    micro = passes["micro_batches_per_update"]  # the update's model FLOP/s: its forward+backward passes / seconds
    for name in ("eager", "compiled"):
        update_s = statistics.median(r["timing_s/update"] for r in runs[name])
        passes[name]["update_flops_per_s"] = micro * passes["flops"] / update_s
        passes[name]["update_fraction_of_peak"] = micro * passes["flops"] / update_s / peak["flops_per_s"]
        passes[name]["update_share_in_model_passes"] = micro * passes[name]["seconds"] / update_s
    write_json({"command": "python benchmarks/compile_update.py " + " ".join(sys.argv[1:]), "config": args.config,
                "torch": torch.__version__, "peak": peak, "model_pass": passes, "loop": runs,
                "loop_speedup_eager_over_compiled": ratio}, args.out, leave_out_of_summary=("loop",))


if __name__ == "__main__":
    main()
