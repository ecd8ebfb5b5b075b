"""A differentiable batch diversity of re-run samples, for the reward back-propagation objectives' optional
diversity term (`diversity_coef`, trainer/objectives/reward_backprop.py).

Over the pairs P = {(i, j): i < j, group_i = group_j} of a piece (a micro-batch of re-run x_0):

    d_ij = sqrt(mean_d (x_i,d - x_j,d)^2 + eps)     RMS distance of the flattened samples (eps keeps the
                                                    gradient finite when two samples coincide)
    D    = mean_{(i,j) in P} d_ij                   0 (no gradient) when no two samples share a prompt group

The RMS (not the sum) over the D dimensions keeps D on the scale of one pixel / latent value, whatever the
resolution. Pairs of different prompts are left out: they differ by their prompts, not by the policy's spread.
"""
from __future__ import annotations

import torch
from torch import Tensor


def group_pairwise_distance(x0: Tensor, group: Tensor, eps: float = 1e-12) -> tuple[Tensor, int]:
    """(D, |P|) of the module docstring for samples x0 [b, ...] in prompt groups `group` [b]."""
    flat = x0.flatten(1)
    i, j = torch.triu_indices(len(flat), len(flat), offset=1, device=flat.device)
    same = group.to(flat.device)[i] == group.to(flat.device)[j]
    i, j = i[same], j[same]
    if len(i) == 0:
        return flat.sum() * 0, 0  # keeps the graph (and dtype) without pushing anything
    d = ((flat[i] - flat[j]).pow(2).mean(dim=1) + eps).sqrt()  # d_ij
    return d.mean(), len(i)  # D = mean over P
