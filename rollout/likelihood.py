"""Sequence log-likelihood estimators for masked-diffusion LMs (docs/testbeds.md, arith).

The likelihood log pi(y | x) of a completion y (L tokens) given a prompt x is intractable; each
estimator below is one Monte-Carlo "step" j, a mask M_j over the completion (and, for the one-step
estimator, over the prompt):

  elbo      l ~ U{1..L}, M = l positions drawn uniformly;      ell = (L / l) * sum_{i in M} log p(y_i | y_{~M}, x)
  coupled   M as for elbo and its complement M^c (M itself when l = L; the partner's size is then
            uniform on 1..L as well, so both halves are the elbo estimator and their mean is unbiased):
            ell = 1/2 [ (L / |M|) sum_{i in M} log p + (L / |M^c|) sum_{i in M^c} log p ]
  one_step  d1: M = every completion token, the prompt masked with probability p (drawn once, shared
            by old and new policy); ell = sum_i log p(y_i | x_{~M_prompt})

`reduce="mean"` divides ell by L: for elbo this is the mean log-prob over the masked tokens (the
per-sample form of SPG/StableDRL's code). The masks are drawn at rollout time and stored in the batch,
so the old, new and reference policies see the same masks unless deliberately decoupled.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from steadyrl.rollout.sampler import LogProb

Estimator = Literal["elbo", "coupled", "one_step"]


@dataclass
class MaskDraw:
    """Masks of n Monte-Carlo samples: completion [B, n, L] and prompt [B, n, P] (True = masked)."""

    completion: Tensor
    prompt: Tensor


def draw_masks(estimator: Estimator, batch_size: int, n: int, gen_length: int, prompt_length: int,
               prompt_mask_prob: float, generator: torch.Generator) -> MaskDraw:
    """Draw the masks an estimator uses (see the module docstring)."""
    B, L, P = batch_size, gen_length, prompt_length
    if estimator == "one_step":
        completion = torch.ones(B, n, L, dtype=torch.bool)
        prompt = torch.rand(B, n, P, generator=generator) < prompt_mask_prob
        return MaskDraw(completion, prompt)
    if estimator not in ("elbo", "coupled"):
        raise ValueError(f"sampler.estimator={estimator!r} must be one of elbo, coupled, one_step")
    count = torch.randint(1, L + 1, (B, n, 1), generator=generator)  # l ~ U{1..L}
    rank = torch.rand(B, n, L, generator=generator).argsort(dim=-1).argsort(dim=-1)  # a uniform permutation
    return MaskDraw(rank < count, torch.zeros(B, n, P, dtype=torch.bool))


def token_log_probs(model, prompt: Tensor, completion: Tensor, completion_mask: Tensor, prompt_mask: Tensor,
                    mask_token_id: int) -> Tensor:
    """log p(y_i | masked input) [B, L] at every completion position from one forward pass."""
    inputs = torch.cat([prompt.masked_fill(prompt_mask, mask_token_id),
                        completion.masked_fill(completion_mask, mask_token_id)], dim=1)
    logits = model(inputs).logits[:, prompt.shape[1]:]
    return torch.log_softmax(logits, dim=-1).gather(-1, completion.unsqueeze(-1)).squeeze(-1)


def masked_estimate(token_logp: Tensor, mask: Tensor) -> Tensor:
    """(L / |M|) * sum_{i in M} log p_i per sample [B] (0 where the mask is empty)."""
    L = mask.shape[-1]
    count = mask.sum(-1).clamp(min=1).to(token_logp.dtype)
    return (token_logp * mask).sum(-1) * (L / count)


@dataclass
class SequenceLogProb(LogProb):
    """One MC sample's estimate `logp` [B] and what it was built from (per-token log-probs [B, L] of the
    masked positions' pass, and the completion mask [B, L]): the masked-diffusion sampler's `log_prob`."""

    token_logp: Tensor
    mask: Tensor


def estimate(model, estimator: Estimator, prompt: Tensor, completion: Tensor, masks: MaskDraw | tuple[Tensor, Tensor],
             mask_token_id: int, reduce: str) -> SequenceLogProb:
    """The estimator's value for one MC sample per row; `masks` = (completion [B, L], prompt [B, P])."""
    cmask, pmask = (masks.completion, masks.prompt) if isinstance(masks, MaskDraw) else masks
    L = completion.shape[1]
    tok = token_log_probs(model, prompt, completion, cmask, pmask, mask_token_id)
    if estimator == "coupled":
        partner = torch.where(cmask.all(-1, keepdim=True), cmask, ~cmask)
        tok_partner = token_log_probs(model, prompt, completion, partner, pmask, mask_token_id)
        value = 0.5 * (masked_estimate(tok, cmask) + masked_estimate(tok_partner, partner))
        tok = torch.where(cmask, tok, tok_partner)  # each token from the pass where it was masked
    else:
        value = masked_estimate(tok, cmask)
    if reduce == "mean":
        value = value / L
    return SequenceLogProb(value, tok, cmask)
