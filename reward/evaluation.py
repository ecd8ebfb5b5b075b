"""Evaluation summaries shared by the training loop's evals and `steadyrl eval`."""
from __future__ import annotations

from typing import Any

from torch import Tensor

from steadyrl.reward.diversity import mean_pairwise_distance, nearest_neighbour_distance
from steadyrl.reward.ensemble import EnsembleScores, finite_mean


def eval_summary(cond: Tensor, group: Tensor, scores: EnsembleScores, gold_name: str,
                 num_classes: int) -> dict[str, Any]:
    """Gold accuracy (overall and per class), training/ensemble reward and within-group diversity."""
    correct = scores.monitors[f"{gold_name}_correct"]
    if scores.features is None:
        raise ValueError("eval_summary needs ensemble features for the diversity measures")
    return {
        "held_out": float(correct.mean()),
        "held_out_per_class": [float(correct[cond == c].mean()) for c in range(num_classes)],
        "proxy_mean": finite_mean(scores.reward),
        "ensemble_mean": finite_mean(scores.mean),
        "diversity_pairwise": mean_pairwise_distance(scores.features, group),
        "diversity_nn": float(nearest_neighbour_distance(scores.features, group).mean()),
        "n_samples": int(cond.shape[0]),
    }


def class_grid(samples: Tensor, num_classes: int, per_class: int) -> Tensor:
    """[classes, k, ...] grid from class-major samples (n per class), keeping the first k of each."""
    n = samples.shape[0] // num_classes
    return samples.view(num_classes, n, *samples.shape[1:])[:, : min(per_class, n)].clone()
