"""The training loop in one process, for algorithm comparisons (no Ray, no Serve).

The same library code as `steadyrl train` -- the run's testbed (prompts, policy, sampler, reward
models), `DeepSpeedLearner` and the objective from the config -- with the services replaced by direct
calls:

    for step: batch = sampler.sample(policy, prompts) -> ensemble.score_all -> learner.update -> sync weights

so a benchmark can run many (method, seed) pairs side by side, one process each.
"""
from __future__ import annotations

import copy
import math
import os
import time
from typing import Any

import torch
from safetensors.torch import load_file

from reward.diversity import mean_pairwise_distance, nearest_neighbour_distance
from reward.ensemble import attach_scores
from services.actors import step_seed
from services.builders import build_learner
from services.config import TrainConfig
from services.runtime import set_rank_env
from services.testbeds import build_testbed

RATIO_KEYS = ("policy/ratio_mean", "policy/ratio_std", "policy/ratio_max", "policy/clip_frac", "policy/grad_norm",
              "policy/kl_ref_monitor")


def run_in_process(cfg: TrainConfig, port: int, eval_every: int = 10, threads: int = 1) -> dict[str, Any]:
    """Train `cfg.run.steps` steps; returns per-step rows (proxy, gold, diversity, ratio statistics)
    and seeded evaluations (step 0, every `eval_every`, last). A step whose loss or gradient is not
    finite ends the run early (`stopped_at`), as a collapse."""
    torch.set_num_threads(threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    set_rank_env(port)
    torch.manual_seed(cfg.run.seed)
    testbed = build_testbed(cfg)
    rollout_policy = testbed.build_policy(load_file(str(testbed.base_weights(progress=False))))
    sampler, eval_sampler = testbed.build_sampler(), testbed.eval_sampler()
    ensemble = testbed.reward_ensemble()
    learner = build_learner(cfg, copy.deepcopy(rollout_policy).train(), testbed.build_sampler())
    gold = testbed.gold_name

    def evaluate(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(cfg.run.eval_seed)
        batch = eval_sampler.sample(rollout_policy, testbed.eval_prompts(), testbed.eval_per_prompt, gen)
        scores = ensemble.score_all(batch.samples, batch.cond, batch.group)
        result = testbed.eval_summary(batch, scores)
        return {"step": step, **{k: v for k, v in result.items() if k not in ("grid", "examples")}}

    rows, evals, stopped = [], [evaluate(0)], None
    for step in range(cfg.run.steps):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(step_seed(cfg.run.seed, step, 0))
        prompts, offset = testbed.train_prompts(0, 1, step)
        batch = sampler.sample(rollout_policy, prompts, cfg.sampler.samples_per_class, gen, group_offset=offset)
        scores = ensemble.score_all(batch.samples, batch.cond, batch.group)
        metrics = learner.update(attach_scores(batch, scores))
        weights = learner.weights()
        rollout_policy.load_state_dict(weights)
        row = {
            "step": step + 1,
            "proxy": float(scores.reward.mean()),
            "gold_accuracy": float(scores.monitors[f"{gold}_correct"].mean()),
            "diversity_nn": float(nearest_neighbour_distance(scores.features, batch.group).mean()),
            "diversity_pairwise": mean_pairwise_distance(scores.features, batch.group),
            "step_s": time.perf_counter() - t0,
        }
        row.update({k: metrics[k] for k in RATIO_KEYS if k in metrics})
        row.update({k: v for k, v in metrics.items() if k.split("/")[0] in ("gardo", "guard", "stabledrl", "bgpo")})
        rows.append(row)
        finite = all(math.isfinite(p.float().abs().max()) for p in weights.values())
        if not finite:
            stopped = step + 1
            evals.append({"step": step + 1, "gold_accuracy": 0.0, "nonfinite_weights": True})
            break
        if (step + 1) % eval_every == 0 or step + 1 == cfg.run.steps:
            evals.append(evaluate(step + 1))
    return {"rows": rows, "evals": evals, "stopped_at": stopped}


def warm_caches(cfg: TrainConfig) -> None:
    """Build (or find) the cached base model and reward models once, before runs start in parallel."""
    testbed = build_testbed(cfg)
    testbed.base_weights(progress=True)
    testbed.prepare_rewards()
