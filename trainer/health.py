"""The training-health panel: per-step statistics of the whole batch that show a run going wrong, computed by the
learner before it splits the batch (so every rank logs the same values), and the hygiene that keeps a bad value
out of the update.

    health/reward_<name>_p10|p50|p90   quantiles (linear interpolation) of each reward model's finite scores
    health/adv_p10|p50|p90, adv_std    the advantages' distribution (std: population)
    health/zero_std_group_frac         share of prompt groups whose training rewards are all equal: no signal
    health/nonfinite_adv_dropped       samples whose advantage was NaN or inf, dropped before the update
    health/nonfinite_grad_steps_skipped optimiser steps skipped because the gradient was NaN or inf (trainer/learner.py)
    health/grad_norm_<group>           L2 norm of the unclipped gradient of each top-level module of the network
                                       (mean over the update's optimiser steps): which part of the model moves

A collapse shows as reward quantiles falling together, a zero-std fraction rising to 1 (every sample alike), or
advantages that turn non-finite.
"""
from __future__ import annotations

import torch
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.balanced_gradient import gradient_norm, group_gradients

QUANTILES = (0.1, 0.5, 0.9)


def quantile_metrics(prefix: str, values: Tensor) -> dict[str, float]:
    """`{prefix}_p10/_p50/_p90` of the finite entries of `values` (none when no entry is finite)."""
    x = values.detach().double().flatten()
    x = x[x.isfinite()]
    if len(x) == 0:
        return {}
    q = torch.quantile(x.cpu(), torch.tensor(QUANTILES, dtype=torch.float64))
    return {f"{prefix}_p{round(100 * p)}": float(v) for p, v in zip(QUANTILES, q)}


def reward_panel(batch: RolloutBatch) -> dict[str, float]:
    """Quantiles of every reward model's scores (the batch's `rewards` [B, K] columns, by name)."""
    if batch.rewards is None:
        return {}
    out: dict[str, float] = {}
    for k, name in enumerate(batch.reward_names):
        out.update(quantile_metrics(f"health/reward_{name}", batch.rewards[:, k]))
    return out


def advantage_panel(advantages: Tensor | None) -> dict[str, float]:
    """Quantiles and population std of the advantages (every entry: [B] or [B, T])."""
    if advantages is None or advantages.numel() == 0:
        return {}
    a = advantages.detach().double()
    return {**quantile_metrics("health/adv", a), "health/adv_std": float(a.std(unbiased=False))}


def zero_std_group_fraction(reward: Tensor, group: Tensor) -> float:
    """Share of prompt groups whose rewards are all equal (their group-normalised advantages are all zero)."""
    groups = group.unique()
    alike = [bool((reward[group == g] == reward[group == g][0]).all()) for g in groups.tolist()]
    return sum(alike) / max(1, len(alike))


def drop_nonfinite_advantages(batch: RolloutBatch) -> tuple[RolloutBatch, int]:
    """The batch without samples whose advantage (any step of it) is NaN or inf, and how many were dropped."""
    if batch.advantages is None:
        return batch, 0
    adv = batch.advantages
    finite = adv.isfinite() if adv.dim() == 1 else adv.isfinite().flatten(1).all(dim=1)
    dropped = int((~finite).sum())
    return (batch.index(torch.nonzero(finite).flatten()) if dropped else batch), dropped


@torch.no_grad()
def group_grad_norms(model: torch.nn.Module) -> dict[str, float]:
    """||g||_2 of each top-level module's accumulated gradients (modules without a gradient left out; a parameter
    of the root module under '')."""
    return {group: float(gradient_norm(grads)) for group, grads in group_gradients(model, 1).items()}


def mean_group_norms(steps: list[dict[str, float]]) -> dict[str, float]:
    """`health/grad_norm_<group>`: each group's norm averaged over the optimiser steps that had one."""
    names = sorted({k for s in steps for k in s})
    return {f"health/grad_norm_{k or 'root'}": sum(s[k] for s in steps if k in s) / sum(k in s for s in steps)
            for k in names}


@torch.no_grad()
def clip_group_gradients(model: torch.nn.Module, max_norm: float, norms: dict[str, float] | None = None) -> int:
    """In place, per top-level module: g <- g * min(1, max_norm / ||g||_2) over the module's accumulated gradients
    (as global clipping, one module at a time: a module whose gradient spikes is held back without shrinking the
    others); `norms`: the modules' norms as `group_grad_norms` gave them, when already computed. Returns how many
    modules were clipped."""
    norms = group_grad_norms(model) if norms is None else norms
    clipped = 0
    for group, grads in group_gradients(model, 1).items():
        if norms[group] > max_norm:
            for g in grads:
                g.mul_(max_norm / norms[group])
            clipped += 1
    return clipped
