"""Group-relative advantages, and the one seam every advantage-based objective computes them through.

`centred_rewards(batch)` is what an objective centres (and maybe scales) within prompt groups:
    no weighting, or weighting `sum`:  the training column r (`batch.train_reward()`), not yet centred
    weighting `per_reward`:            A_i = sum_k w_k (r_k,i - mean_g r_k) / (std_g r_k + eps_std), already
                                       centred and scaled (reward/weighting.py), so the objective adds nothing
"""
from __future__ import annotations

import torch
from torch import Tensor

from steadyrl.reward.weighting import WEIGHTING_KEY, RewardWeighting
from steadyrl.rollout.batch import RolloutBatch


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


def batch_weighting(batch: RolloutBatch) -> RewardWeighting | None:
    """The reward weighting the batch's rewards were combined with (None: one training column as before)."""
    return batch.meta.get(WEIGHTING_KEY)


def per_reward_advantages(rewards: Tensor, names: list[str], group: Tensor, weighting: RewardWeighting) -> Tensor:
    """A_i = sum_k w_k z_k,i,  z_k,i = (r_k,i - mean_g r_k) / (std_g r_k + eps_std)  (w normalised to sum 1;
    weight-0 rewards left out)."""
    adv = torch.zeros(rewards.shape[0], dtype=rewards.dtype, device=rewards.device)
    for name, w in weighting.normalised().items():
        if w > 0:
            adv = adv + w * group_advantages(rewards[:, names.index(name)], group, weighting.eps_std)
    return adv


def centred_rewards(batch: RolloutBatch) -> tuple[Tensor, bool]:
    """(signal, normalised): the training column and False, or under a `per_reward` weighting its advantage
    sum_k w_k z_k and True (already group-centred and scaled: the objective must not centre or scale it again)."""
    weighting = batch_weighting(batch)
    if weighting is None or weighting.normalise == "sum":
        return batch.train_reward(), False
    return per_reward_advantages(batch.rewards, batch.reward_names, batch.group, weighting), True


def batch_advantages(batch: RolloutBatch, eps_std: float | None) -> Tensor:
    """The unclipped advantage of every advantage-based objective (module docstring):
        A_i = (r_i - mean_g r) / (std_g r + eps_std)   eps_std given (GRPO and the objectives built on it)
        A_i = r_i - mean_g r                           eps_std None (StableDRL's code, d1: no std division)
        A_i = sum_k w_k z_k,i                          under a per_reward weighting, whatever the objective."""
    signal, normalised = centred_rewards(batch)
    if normalised:
        return signal
    if eps_std is None:
        return mean_centred_advantages(signal, batch.group)
    return group_advantages(signal, batch.group, eps_std)
