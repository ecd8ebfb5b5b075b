"""Correcting for a lagged behaviour policy (asynchronous rollouts), the decoupled PPO objective.

With one-step-off-policy pipelining the rollout workers sample step k+1 while the learner trains on step k, so
a batch comes from a behaviour policy pi_b that is `staleness` updates older than the learner. Its log-probs
(`batch.old_logp`, written by the sampler) are kept; the learner recomputes the proximal policy's
(`OldPolicy.logp`, the current weights at the start of the update) beside them, and each term is weighted by

    w = min(pi_prox(x) / pi_b(x), c) = min(exp(logp_prox - logp_b), c)          (detached)

so the objective is  E_{x ~ pi_b}[ w * f(rho) A ]  with rho = pi_theta / pi_prox: the ratio that is clipped stays
the on-policy one (decoupled PPO, Hilton et al. 2022; the form AReaL uses for asynchronous RL), and w, truncated
at c as V-trace truncates its importance weights, moves the expectation from pi_b to pi_prox. For a loss linear
in A per term (GRPO's PPO clip, StableDRL's clipped self-normalised terms) weighting a term by w is weighting
its advantage, which is how the learner applies it. A sample from the current policy (staleness 0) has w = 1
exactly: synchronous runs are unchanged.
"""
from __future__ import annotations

import torch
from torch import Tensor

from steadyrl.rollout.batch import POLICY_VERSION, RolloutBatch


def staleness(batch: RolloutBatch, learner_version: int) -> Tensor:
    """[B] updates between each sample's behaviour policy and the learner (0 without a recorded version)."""
    version = batch.extras.get(POLICY_VERSION)
    if version is None:
        return torch.zeros(len(batch), dtype=torch.long)
    return learner_version - version.long().cpu()


def check_staleness(lag: Tensor, max_staleness: int) -> None:
    """Refuse a batch older than the bound (or from a policy the learner has not reached)."""
    if len(lag) and int(lag.max()) > max_staleness:
        raise ValueError(f"a batch sampled {int(lag.max())} updates ago exceeds learner.max_staleness={max_staleness}")
    if len(lag) and int(lag.min()) < 0:
        raise ValueError(f"a batch claims a policy version {-int(lag.min())} updates ahead of the learner")


def behaviour_weight(proximal_logp: Tensor, behaviour_logp: Tensor, lagged: Tensor, cap: float) -> Tensor:
    """w = min(exp(logp_prox - logp_b), cap) where `lagged` (broadcast over trailing dims), else exactly 1."""
    lagged = lagged.to(proximal_logp.device).view(-1, *([1] * (proximal_logp.dim() - 1)))
    w = torch.exp(proximal_logp - behaviour_logp.to(proximal_logp)).clamp(max=cap)
    return torch.where(lagged, w, torch.ones_like(w))
