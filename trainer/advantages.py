"""Group-relative advantages."""
from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, group: Tensor, eps_std: float) -> Tensor:
    """A_i = (r_i - mean_g r) / (std_g r + eps_std) within each prompt group g (population std)."""
    adv = torch.zeros_like(rewards)
    for g in group.unique():
        idx = group == g
        r = rewards[idx]
        adv[idx] = (r - r.mean()) / (r.std(unbiased=False) + eps_std)
    return adv


def mean_centred_advantages(rewards: Tensor, group: Tensor) -> Tensor:
    """A_i = r_i - mean_g r within each prompt group g (no std division: StableDRL's code, d1)."""
    adv = torch.zeros_like(rewards)
    for g in group.unique():
        idx = group == g
        adv[idx] = rewards[idx] - rewards[idx].mean()
    return adv
