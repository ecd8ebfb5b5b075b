"""KL divergences between Gaussian sampling steps."""
from __future__ import annotations

from torch import Tensor


def gaussian_kl_same_std(mean_p: Tensor, mean_q: Tensor, std: Tensor, reduce: str = "mean") -> Tensor:
    """KL(N(mu_p, s^2 I) || N(mu_q, s^2 I)) = ||mu_p - mu_q||^2 / (2 s^2), per sample ([B]).

    `reduce='mean'` divides by the number of dimensions (matching a mean-over-pixels log-prob);
    `reduce='sum'` is the exact KL of the whole step.
    """
    sq = (mean_p - mean_q) ** 2 / (2 * std.view(-1, *([1] * (mean_p.dim() - 1))) ** 2)
    dims = tuple(range(1, mean_p.dim()))
    return sq.mean(dim=dims) if reduce == "mean" else sq.sum(dim=dims)
