"""SPG's sandwich bound on dLLM log-likelihoods (Wang et al., facebookresearch/SPG; StableDRL's code).

From the per-token log-probs of n MC mask samples j (mask m_j over the completion's L_V scored tokens,
those up to the first EOS; t_j = |m_j| / L_V, the empirical mask rate; p_ij = exp(log p_ij)):

    ELBO  = mean_j [ sum_i m_ij log p_ij / sum_i m_ij ]                  a per-sample mean (lower bound / L)
    q_i   = mean_j [ p_ij^beta * m_ij / t_j ]
    EUBO  = (1 / beta) * sum_i 1[q_i > 0] log q_i / sum_i 1[q_i > 0]     (upper bound / L; beta = 1.5)
    J     = ELBO                       if A > 0 (strictly)
          = w * EUBO + (1 - w) * ELBO  otherwise (w = 0.5)

The learner back-propagates one MC sample at a time, so the EUBO -- a log of a mean over j -- is split
into per-sample pieces with the same trick as the ELBO: with q and EUBO from the no-grad pass,

    U_j = (1 / beta) * sum_i [1[q_i > 0] / (sum 1[q > 0] * q_i)] * p_ij^beta m_ij / (t_j n)
    EUBO_j = sg(EUBO) + U_j - sg(U_j)        value EUBO, and sum_j grad U_j = grad EUBO exactly.

`scale` multiplies both bounds (L_V under a `sum` log-prob reduction, so they are on the ELBO's scale).
"""
from __future__ import annotations

import torch
from torch import Tensor

from steadyrl.rollout.likelihood import SequenceLogProb


def _mask_rate(sample: SequenceLogProb) -> Tensor:
    """t_j = |m_j| / L_V per row [B, 1], in the log-probs' dtype."""
    dtype = sample.token_logp.dtype
    return (sample.mask.sum(-1, keepdim=True).to(dtype) / sample.lengths.unsqueeze(-1).to(dtype)).clamp(min=1e-12)


def eubo_statistics(samples: list[SequenceLogProb], beta: float) -> tuple[Tensor, Tensor]:
    """(q [B, L], EUBO [B]) from every MC sample's per-token terms (no gradient needed)."""
    q = sum((s.token_logp * beta).exp() * s.mask / _mask_rate(s) for s in samples)
    q = q / len(samples)
    seen = q > 0
    log_q = torch.where(seen, q, torch.ones_like(q)).log()  # their code: zeros replaced by 1 before the log
    eubo = (log_q * seen).sum(-1) / seen.sum(-1).clamp(min=1) / beta
    return q, eubo


def eubo_piece(sample: SequenceLogProb, q: Tensor, eubo: Tensor, beta: float, n: int) -> Tensor:
    """EUBO_j (value EUBO, gradient its share from MC sample j) for one piece, [B]."""
    seen = q > 0
    weight = torch.where(seen, 1 / (seen.sum(-1, keepdim=True).clamp(min=1) * torch.where(seen, q, torch.ones_like(q))),
                         torch.zeros_like(q))
    rate = _mask_rate(sample)
    u = ((sample.token_logp * beta).exp() * sample.mask / (rate * n) * weight.detach()).sum(-1) / beta
    return eubo.detach() + u - u.detach()


def sandwich(elbo: Tensor, eubo: Tensor, advantages: Tensor, mix: float) -> Tensor:
    """J = ELBO where A > 0, mix * EUBO + (1 - mix) * ELBO elsewhere."""
    return elbo.where(advantages > 0, mix * eubo + (1 - mix) * elbo)
