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

from steadyrl.reward.diversity import mean_pairwise_distance
from steadyrl.reward.ensemble import attach_scores
from steadyrl.rollout.policy import load_trainable_state
from steadyrl.services.actors import step_seed
from steadyrl.services.builders import build_learner
from steadyrl.services.config import TrainConfig
from steadyrl.services.runtime import set_rank_env
from steadyrl.services.testbeds import build_testbed

RATIO_KEYS = ("policy/ratio_mean", "policy/ratio_std", "policy/ratio_max", "policy/clip_frac", "policy/grad_norm",
              "policy/kl_ref_monitor")


def run_in_process(cfg: TrainConfig, port: int, eval_every: int = 10, threads: int = 1) -> dict[str, Any]:
    """Train `cfg.run.steps` steps; returns per-step rows (proxy, gold, diversity, ratio statistics)
    and seeded evaluations (step 0, every `eval_every`, last). A step whose loss or gradient is not
    finite ends the run early (`stopped_at`), as a collapse."""
    torch.set_num_threads(threads)
    gpu = cfg.ray.learner_gpus > 0 and torch.cuda.is_available()
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if gpu else "cpu")
    device = torch.device("cuda" if cfg.ray.rollout_gpus > 0 and torch.cuda.is_available() else "cpu")
    set_rank_env(port)
    torch.manual_seed(cfg.run.seed)
    testbed = build_testbed(cfg)
    rollout_policy = testbed.build_policy(load_file(str(testbed.base_weights(progress=False)))).to(device)
    sampler, eval_sampler = testbed.build_sampler(), testbed.eval_sampler()
    ensemble = testbed.reward_ensemble()
    learner = build_learner(cfg, copy.deepcopy(rollout_policy).train(), testbed.build_sampler())

    def evaluate(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(cfg.run.eval_seed)
        batch = testbed.sample(eval_sampler, rollout_policy, testbed.eval_prompts(), testbed.eval_per_prompt, gen)
        scores = ensemble.score_all(*testbed.reward_inputs(rollout_policy, batch), batch.group)
        result = testbed.eval_summary(batch, scores)
        return {"step": step, **{k: v for k, v in result.items() if k not in ("grid", "examples", "images", "captions")}}

    rows, evals, stopped = [], [evaluate(0)], None
    for step in range(cfg.run.steps):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(step_seed(cfg.run.seed, step, 0))
        prompts, offset = testbed.train_prompts(0, 1, step)
        batch = testbed.sample(sampler, rollout_policy, prompts, cfg.sampler.samples_per_class, gen, group_offset=offset)
        scores = ensemble.score_all(*testbed.reward_inputs(rollout_policy, batch), batch.group)
        metrics = learner.update(attach_scores(batch, scores))
        weights = learner.weights()
        load_trainable_state(rollout_policy, weights)
        summary = testbed.rollout_summary(batch, scores)
        row = {
            "step": step + 1,
            "proxy": summary["reward/train_mean"],
            "gold_accuracy": summary["reward/gold_accuracy"],
            "diversity_nn": summary["diversity/nn_distance"],
            "diversity_pairwise": (0.0 if scores.features is None else
                                   mean_pairwise_distance(scores.features, batch.group)),
            "step_s": time.perf_counter() - t0,
            "sync_bytes": metrics.get("sync/bytes", 0.0),
            "logp_absdiff_max": metrics.get("policy/rollout_logp_absdiff_max", 0.0),
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
