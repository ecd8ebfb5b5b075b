"""Per-reward statistics of a weighted multi-reward batch (reward/weighting.py), for the learner's metrics.

For each weighted reward k (w_k normalised to sum 1), over the update's batch of B samples:

    reward/<k>_weight     w_k
    reward/<k>_std        population std of r_k over the batch
    reward/<k>_group_std  mean over prompt groups g of std_g r_k (0: the reward cannot rank the group's samples)
    reward/<k>_adv_share  s_k = sum_i |w_k c_k,i| / sum_j sum_i |w_j c_j,i|     (sum_k s_k = 1; all 0
                          when no weighted reward varies within any group)
                          c_k,i = z_k,i = (r_k,i - mean_g r_k) / (std_g r_k + eps_std)   per_reward
                          c_k,i = r_k,i - mean_g r_k                                      sum
                          (the part of the combined, centred signal sum_k w_k c_k,i that reward k supplies)
    reward/<k>_adv_corr   Pearson correlation over the batch of z_k with the objective's final advantage A
                          (clipped, diversity-weighted, ...; mean over steps if per step); 0 when either is constant

The mean of each reward is the rollouts' `reward/<k>`. A batch without a weighting gets none of these.
"""
from __future__ import annotations

import torch
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.advantages import batch_weighting, group_advantages, mean_centred_advantages


def pearson(x: Tensor, y: Tensor) -> float:
    """corr(x, y) = cov(x, y) / (std x std y) (population), 0 when either is constant."""
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denom = float(x.norm() * y.norm())
    return float((x * y).sum()) / denom if denom > 0 else 0.0


def weighting_panel(batch: RolloutBatch) -> dict[str, float]:
    """The per-reward metrics of the module docstring ({} without a weighting)."""
    weighting = batch_weighting(batch)
    if weighting is None or batch.rewards is None:
        return {}
    weights = weighting.normalised()
    cols = {k: batch.rewards[:, batch.reward_names.index(k)].double() for k in weights}
    z = {k: group_advantages(r, batch.group, weighting.eps_std) for k, r in cols.items()}
    c = z if weighting.normalise == "per_reward" else {k: mean_centred_advantages(r, batch.group)
                                                       for k, r in cols.items()}
    mass = {k: float((weights[k] * c[k]).abs().sum()) for k in weights}
    total = sum(mass.values())
    adv = batch.advantages
    if adv is not None and adv.dim() > 1:
        adv = adv.double().flatten(1).mean(dim=1)
    out: dict[str, float] = {}
    groups = batch.group.unique()
    for k, r in cols.items():
        out[f"reward/{k}_weight"] = weights[k]
        out[f"reward/{k}_std"] = float(r.std(unbiased=False))
        out[f"reward/{k}_group_std"] = float(torch.stack([r[batch.group == g].std(unbiased=False)
                                                          for g in groups]).mean())
        out[f"reward/{k}_adv_share"] = mass[k] / total if total > 0 else 0.0
        if adv is not None:
            out[f"reward/{k}_adv_corr"] = pearson(z[k], adv)
    return out
