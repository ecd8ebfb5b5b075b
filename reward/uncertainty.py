"""Uncertainty of a proxy reward from its disagreement with auxiliary rewards (GARDO), over one batch.

Rank difference (GARDO's code, `train_sd3_grpo_gardo.py`): over the whole batch (not per prompt group),
    rank_k(i) = 1 + #{j ranked before i under model k}   (rank 1 = highest score)
    u_i       = rank_main(i) - mean_k rank_aux_k(i)         sign "code"
    u_i       = mean_k rank_aux_k(i) - rank_main(i)         sign "over_rating"
"code": u > 0 when the proxy ranks i *worse* than the auxiliaries do; "over_rating": when it ranks i
better. Ties are ordinal in index order (a stable sort); NaN scores rank last. Sum_i u_i = 0.

Leave-one-out Kendall disagreement (GARDO's seed form). tau_b(S) between the proxy and auxiliary k on a
sample set S (0 when either is constant on S). For sample i of the n-sample batch S:
    g_i = (n - 2)/2 * mean_k [ tau_b^k(S minus i) - tau_b^k(S) ]
how much removing i raises the models' agreement, scaled so that without ties g_i = tau - tau_i exactly,
where tau_i = (c_i - d_i)/(n - 1) is i's own agreement (its concordant minus discordant pairs) and
tau = mean_i tau_i. So g_i lies in [-2, 2]; g_i > delta means i's pairs agree less than the batch does
by more than delta. n < 3: g = 0.
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor


def descending_ranks(scores: Tensor) -> Tensor:
    """Ranks along dim 0 (1 = highest; ties ordinal in index order; NaN last), as float64."""
    x = torch.nan_to_num(scores.double(), nan=-torch.inf)
    order = torch.sort(-x, dim=0, stable=True).indices
    ranks = torch.empty_like(x)
    pos = torch.arange(1, x.shape[0] + 1, dtype=torch.float64)
    if x.dim() == 1:
        ranks[order] = pos
    else:
        ranks.scatter_(0, order, pos[:, None].expand_as(x).contiguous())
    return ranks


def rank_difference_uncertainty(main: Tensor, aux: Tensor,
                                sign: Literal["code", "over_rating"] = "code") -> Tensor:
    """u [B] from the proxy scores `main` [B] and the auxiliary scores `aux` [B,K] (module docstring)."""
    if aux.dim() != 2 or aux.shape[1] == 0 or aux.shape[0] != main.shape[0]:
        raise ValueError(f"aux must be [B,K>=1] with B={main.shape[0]}, got {tuple(aux.shape)}")
    u = descending_ranks(main) - descending_ranks(aux).mean(dim=1)
    return u if sign == "code" else -u


def _signs(x: Tensor) -> Tensor:
    """[n,n] sign(x_i - x_j)."""
    return torch.sign(x[:, None] - x[None, :])


def leave_one_out_kendall(main: Tensor, aux: Tensor) -> tuple[Tensor, Tensor]:
    """tau_b between `main` [n] and each column of `aux` [n,K]: ([K] on the batch, [n,K] without sample i).

    Closed form from the pair-sign matrices: P = sum of concordances, T = tied pairs per variable.
    """
    n = main.shape[0]
    sm = _signs(main.double())
    tm = (sm == 0).sum(dim=1).double() - 1  # [n] samples tied with i under main
    full, loo = [], []
    for k in range(aux.shape[1]):
        sa = _signs(aux[:, k].double())
        ta = (sa == 0).sum(dim=1).double() - 1
        conc = sm * sa
        q = conc.sum(dim=1)  # [n] c_i - d_i
        p = q.sum() / 2
        pairs = n * (n - 1) / 2
        tie_m, tie_a = tm.sum() / 2, ta.sum() / 2
        full.append(_safe_div(p, ((pairs - tie_m) * (pairs - tie_a)).sqrt()))
        pairs_i = (n - 1) * (n - 2) / 2
        den = ((pairs_i - (tie_m - tm)) * (pairs_i - (tie_a - ta))).sqrt()
        loo.append(_safe_div(p - q, den))
    return torch.stack(full), torch.stack(loo, dim=1)


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    return torch.where(den > 0, num / den.clamp(min=1e-300), torch.zeros_like(num))


def kendall_gate_score(main: Tensor, aux: Tensor) -> Tensor:
    """g [n] = (n - 2)/2 * mean_k [tau_b^k(S minus i) - tau_b^k(S)] (module docstring); 0 when n < 3."""
    n = main.shape[0]
    if n < 3:
        return torch.zeros(n, dtype=torch.float64)
    full, loo = leave_one_out_kendall(main, aux)
    return (n - 2) / 2 * (loo - full[None, :]).mean(dim=1)
