"""The training loop in one process, for algorithm comparisons (no Ray, no Serve).

The same library code as `steadyrl train` — `build_sampler`, the reward ensemble, `DeepSpeedLearner`
and the objective from the config — with the services replaced by direct calls:

    for step: batch = sampler.sample(policy) -> ensemble.score_all -> learner.update -> sync weights

so a benchmark can run many (method, seed) pairs side by side, one process each.
"""
from __future__ import annotations

import copy
import os
import time
from typing import Any

import torch
from safetensors.torch import load_file

from reward.config import build_reward_models
from reward.diversity import mean_pairwise_distance, nearest_neighbour_distance
from reward.ensemble import RewardEnsemble, attach_scores
from reward.evaluation import eval_summary
from rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from rollout.models import unet_from_weights
from rollout.samplers import build_sampler
from services.actors import step_seed
from services.builders import build_learner
from services.config import TrainConfig
from services.runtime import set_rank_env
from trainer.pretrain import ensure_pretrained_unet

RATIO_KEYS = ("policy/ratio_mean", "policy/ratio_std", "policy/ratio_max", "policy/clip_frac", "policy/grad_norm",
              "policy/kl_ref_monitor")


def run_in_process(cfg: TrainConfig, port: int, eval_every: int = 10, threads: int = 1) -> dict[str, Any]:
    """Train `cfg.run.steps` steps; returns per-step rows (proxy, gold, diversity, ratio statistics)
    and seeded evaluations (step 0, every `eval_every`, last)."""
    torch.set_num_threads(threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    set_rank_env(port)
    torch.manual_seed(cfg.run.seed)
    weights = load_file(str(ensure_pretrained_unet(cfg.model, cfg.scheduler, cfg.pretrain, progress=False,
                                                   prediction=cfg.sampler.prediction)))
    rollout_policy = unet_from_weights(cfg.model, weights)
    sampler = build_sampler(cfg.sampler, cfg.scheduler)
    members, monitors, feature_name = build_reward_models(cfg.reward)
    ensemble = RewardEnsemble(members, cfg.reward.train_on, monitors, next(m for m in members if m.name == feature_name))
    learner = build_learner(cfg, copy.deepcopy(rollout_policy).train())
    gold = cfg.reward.gold.name
    classes = torch.arange(NUM_CLASSES)

    def evaluate(step: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(cfg.run.eval_seed)
        batch = sampler.sample(rollout_policy, classes, cfg.run.eval_samples_per_class, gen, sample_shape=IMAGE_SHAPE)
        scores = ensemble.score_all(batch.samples, batch.cond, batch.group)
        return {"step": step, **eval_summary(batch.cond, batch.group, scores, gold, NUM_CLASSES)}

    rows, evals = [], [evaluate(0)]
    for step in range(cfg.run.steps):
        t0 = time.perf_counter()
        gen = torch.Generator().manual_seed(step_seed(cfg.run.seed, step, 0))
        batch = sampler.sample(rollout_policy, classes, cfg.sampler.samples_per_class, gen, sample_shape=IMAGE_SHAPE)
        scores = ensemble.score_all(batch.samples, batch.cond, batch.group)
        metrics = learner.update(attach_scores(batch, scores))
        rollout_policy.load_state_dict(learner.weights())
        row = {
            "step": step + 1,
            "proxy": float(scores.reward.mean()),
            "gold_accuracy": float(scores.monitors[f"{gold}_correct"].mean()),
            "diversity_nn": float(nearest_neighbour_distance(scores.features, batch.group).mean()),
            "diversity_pairwise": mean_pairwise_distance(scores.features, batch.group),
            "step_s": time.perf_counter() - t0,
        }
        row.update({k: metrics[k] for k in RATIO_KEYS if k in metrics})
        row.update({k: v for k, v in metrics.items() if k.split("/")[0] in ("gardo", "guard", "stabledrl")})
        rows.append(row)
        if (step + 1) % eval_every == 0 or step + 1 == cfg.run.steps:
            evals.append(evaluate(step + 1))
    return {"rows": rows, "evals": evals}


def warm_caches(cfg: TrainConfig) -> None:
    """Build (or find) the cached base model and reward classifiers once, before runs start in parallel."""
    ensure_pretrained_unet(cfg.model, cfg.scheduler, cfg.pretrain, progress=True, prediction=cfg.sampler.prediction)
    build_reward_models(cfg.reward)
