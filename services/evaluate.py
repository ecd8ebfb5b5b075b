"""`steadyrl eval RUN_DIR`: score a checkpoint's samples with the gold classifier, locally."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from reward.classifiers import load_classifier
from reward.diversity import mean_pairwise_distance, nearest_neighbour_distance
from rollout.ddim import DDIMLogProbSampler
from rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from rollout.models import build_scheduler, build_unet
from services.config import load_config
from services.controller import CHECKPOINTS, latest_checkpoint
from services.report import save_sample_grid


def evaluate_checkpoint(run_dir: Path, step: int | None = None, n_per_class: int | None = None,
                        seed: int | None = None) -> dict[str, Any]:
    """Gold accuracy per class, proxy reward, diversity and a sample grid for one checkpoint."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    ckpt = latest_checkpoint(run_dir) if step is None else run_dir / CHECKPOINTS / f"step_{step}"
    if ckpt is None or not ckpt.exists():
        raise FileNotFoundError(f"no checkpoint {'latest' if step is None else f'step_{step}'} in {run_dir}")
    n = n_per_class or cfg.run.eval_samples_per_class
    policy = build_unet(cfg.model)
    policy.load_state_dict(load_file(str(ckpt / "policy.safetensors")))
    policy.eval()
    sampler = DDIMLogProbSampler(cfg.sampler, build_scheduler(cfg.scheduler))
    gen = torch.Generator().manual_seed(cfg.run.eval_seed if seed is None else seed)
    batch = sampler.sample(policy, torch.arange(NUM_CLASSES), n, gen, sample_shape=IMAGE_SHAPE)
    gold = load_classifier(cfg.reward.gold)
    feats_model = load_classifier(next(s for s in cfg.reward.members if s.name == cfg.reward.feature_model))
    proxy_spec = next((s for s in cfg.reward.members if s.name == cfg.reward.train_on), None)
    correct = gold.correct(batch.samples, batch.cond)
    feats = feats_model.features(batch.samples)
    result = {
        "checkpoint": str(ckpt),
        "gold_accuracy": float(correct.mean()),
        "gold_accuracy_per_class": [float(correct[batch.cond == c].mean()) for c in range(NUM_CLASSES)],
        "proxy_mean": float(load_classifier(proxy_spec).score(batch.samples, batch.cond).mean()) if proxy_spec else None,
        "diversity_pairwise": mean_pairwise_distance(feats, batch.group),
        "diversity_nn": float(nearest_neighbour_distance(feats, batch.group).mean()),
        "n_samples": len(batch),
    }
    out = run_dir / f"eval_{ckpt.name}"
    out.mkdir(exist_ok=True)
    grid = batch.samples.view(NUM_CLASSES, n, *IMAGE_SHAPE)[:, : min(n, 8)]
    save_sample_grid(grid, out / "samples.png", f"{ckpt.name}: gold accuracy {result['gold_accuracy']:.1%}",
                     result["gold_accuracy_per_class"])
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result
