"""Diversity of samples within their groups, measured in a feature network's space."""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


def _nearest_within_groups(features: Tensor, group: Tensor, distance: Callable[[Tensor], Tensor]) -> Tensor:
    """d_i = min_{j != i, same group} distance(f)[i, j]  ([B]; 0 for a sample alone in its group)."""
    out = torch.zeros(features.shape[0], dtype=features.dtype)
    for g in group.unique():
        idx = torch.nonzero(group == g).flatten()
        if len(idx) < 2:
            continue
        d = distance(features[idx])
        d.fill_diagonal_(float("inf"))
        out[idx] = d.min(dim=1).values
    return out


def nearest_neighbour_distance(features: Tensor, group: Tensor) -> Tensor:
    """d_i = min_{j != i, same group} ||f_i - f_j||_2  ([B]; 0 for a sample alone in its group)."""
    return _nearest_within_groups(features, group, lambda f: torch.cdist(f, f))


def mean_pairwise_distance(features: Tensor, group: Tensor) -> float:
    """Mean over groups of the mean pairwise feature distance within the group."""
    vals = []
    for g in group.unique():
        f = features[group == g]
        n = f.shape[0]
        if n < 2:
            continue
        vals.append(torch.cdist(f, f).sum().item() / (n * (n - 1)))
    return float(sum(vals) / len(vals)) if vals else 0.0


def cosine_nearest_neighbour_distance(features: Tensor, group: Tensor) -> Tensor:
    """d_i = min_{j != i, same group} (1 - cos(f_i, f_j)), cosines clipped to [-1, 1] ([B]; 0 for a
    sample alone in its group). Features are L2-normalised first (GARDO's diversity)."""
    f = torch.nn.functional.normalize(features.double(), dim=1)
    return _nearest_within_groups(f, group, lambda x: 1 - (x @ x.T).clamp(-1, 1))
