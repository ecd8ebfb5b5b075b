"""`steadyrl eval RUN_DIR`: score a checkpoint's seeded samples in-process (no Ray needed)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from reward.config import build_reward_models
from reward.ensemble import RewardEnsemble
from reward.evaluation import class_grid, eval_summary
from rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from rollout.models import unet_from_weights
from rollout.samplers import build_sampler
from services.config import load_config
from services.controller import CHECKPOINTS, latest_checkpoint
from services.report import save_sample_grid


def evaluate_checkpoint(run_dir: Path, step: int | None = None, n_per_class: int | None = None,
                        seed: int | None = None) -> dict[str, Any]:
    """Gold accuracy per class, proxy reward, diversity and a sample grid for one checkpoint.

    Writes RUN_DIR/eval_step_N/{eval.json,samples.png}.
    """
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    ckpt = latest_checkpoint(run_dir) if step is None else run_dir / CHECKPOINTS / f"step_{step}"
    if ckpt is None or not ckpt.exists():
        raise FileNotFoundError(f"no checkpoint {'latest' if step is None else f'step_{step}'} in {run_dir}")
    n = n_per_class or cfg.run.eval_samples_per_class
    policy = unet_from_weights(cfg.model, load_file(str(ckpt / "policy.safetensors")))
    sampler = build_sampler(cfg.sampler, cfg.scheduler)
    gen = torch.Generator().manual_seed(cfg.run.eval_seed if seed is None else seed)
    batch = sampler.sample(policy, torch.arange(NUM_CLASSES), n, gen, sample_shape=IMAGE_SHAPE)
    members, monitors, feature_name = build_reward_models(cfg.reward)
    ensemble = RewardEnsemble(members, cfg.reward.train_on, monitors,
                              next(m for m in members if m.name == feature_name))
    scores = ensemble.score_all(batch.samples, batch.cond, batch.group)
    result = {"checkpoint": str(ckpt), **eval_summary(batch.cond, batch.group, scores, cfg.reward.gold.name,
                                                      NUM_CLASSES)}
    out = run_dir / f"eval_{ckpt.name}"
    out.mkdir(exist_ok=True)
    save_sample_grid(class_grid(batch.samples, NUM_CLASSES, 8), out / "samples.png",
                     f"{ckpt.name}: gold accuracy {result['gold_accuracy']:.1%}", result["gold_accuracy_per_class"])
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result
