"""Rollout with log-probs against plain inference: what steadyrl's samplers cost over diffusers' own scheduler loop.

    python benchmarks/rollout_overhead.py [--repeats 15] [--out benchmarks/results/rollout_overhead.json]

For each digits preset (DDIM: configs/digits-grpo.yaml; flow SDE: configs/digits-flow-grpo.yaml), the same UNet
(the preset's architecture, random weights: timing does not depend on them), the same number of steps, batch
(10 classes x the preset's group size), dtype and torch threads:

- ours:  the preset's sampler, `sampler.sample(...)`: every step's Gaussian mean, noise and log-prob, the
         trajectory kept for the learner;
- plain: diffusers' own loop over the same noise levels: `DDIMScheduler.step(eps, t, x, eta)` (the preset's eta),
         or `FlowMatchEulerDiscreteScheduler.step(v, t, x)` (the deterministic Euler step; diffusers has no flow SDE).

The two alternate within each repeat (ours, plain, ours, ...) so that the machine's drift hits both; the JSON holds
every time, the median ratio ours / plain and its spread (min..max of the per-repeat ratios). Target: <= 1.05.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PRESETS = {"ddim": "configs/digits-grpo.yaml", "flow_sde": "configs/digits-flow-grpo.yaml"}


@torch.no_grad()
def plain_loop(kind: str, policy, sampler, cfg, cond: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """diffusers' scheduler loop over the sampler's steps (no log-probs, no trajectory)."""
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    from steadyrl.rollout.models import build_scheduler

    x = torch.randn((len(cond), 1, 8, 8), generator=generator)
    if kind == "ddim":
        sched = DDIMScheduler.from_config(build_scheduler(cfg.testbed.scheduler).config)
        sched.set_timesteps(cfg.sampler.num_steps)
        for t in sched.timesteps:
            eps = policy(x, t.expand(len(x)), cond)
            x = sched.step(eps, t, x, eta=cfg.sampler.eta, generator=generator).prev_sample
        return x
    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=cfg.testbed.scheduler.num_train_timesteps,
                                            shift=cfg.sampler.shift)
    sched.set_timesteps(cfg.sampler.num_steps)
    for t in sched.timesteps:
        v = policy(x, t.expand(len(x)), cond)
        x = sched.step(v, t, x).prev_sample
    return x


def measure(kind: str, repeats: int) -> dict:
    from steadyrl.rollout.models import build_class_policy
    from steadyrl.services.config import load_config
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(ROOT / PRESETS[kind], [])
    torch.manual_seed(0)
    policy = build_class_policy(cfg.testbed.model).eval()
    sampler = build_testbed(cfg).build_sampler()
    classes = torch.arange(10)
    cond = classes.repeat_interleave(cfg.sampler.group_size)
    ours_s, plain_s = [], []
    for r in range(repeats + 1):  # the first pair warms caches and is dropped
        g = torch.Generator().manual_seed(r)
        t0 = time.perf_counter()
        sampler.sample(policy, classes, cfg.sampler.group_size, g)
        t1 = time.perf_counter()
        plain_loop(kind, policy, sampler, cfg, cond, torch.Generator().manual_seed(r))
        t2 = time.perf_counter()
        if r:
            ours_s.append(t1 - t0)
            plain_s.append(t2 - t1)
    ratios = [o / p for o, p in zip(ours_s, plain_s)]
    return {"preset": PRESETS[kind], "steps": cfg.sampler.num_steps, "batch": len(cond),
            "ours_s": ours_s, "plain_s": plain_s, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rollout_overhead.json")
    args = ap.parse_args()
    results = {"torch_threads": torch.get_num_threads(), "repeats": args.repeats,
               "samplers": {kind: measure(kind, args.repeats) for kind in PRESETS}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    for kind, r in results["samplers"].items():
        print(f"{kind:9s} ours/plain median {r['ratio_median']:.3f} (min {r['ratio_min']:.3f}, max "
              f"{r['ratio_max']:.3f}); ours {statistics.median(r['ours_s']):.3f} s, plain "
              f"{statistics.median(r['plain_s']):.3f} s for {r['batch']} samples x {r['steps']} steps")


if __name__ == "__main__":
    main()
