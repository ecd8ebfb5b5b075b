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

How elbo/coupled masks M are drawn is the mask scheme (`sampler.mask_scheme`):

  uniform       each MC sample on its own: l ~ U{1..L}, l positions uniformly
  stratified    LLaDA's `get_log_likelihood`: the n MC samples of a sequence share one draw k ~ U{1..L} and
                take the counts  l_j = ((round(k + j L / n) - 1) mod L) + 1,  j = 0..n-1,  spread evenly
                over 1..L (each still uniform on its own), positions uniformly
  block_random  SPG/StableDRL: blocks of `block_length`; MC sample j takes block b_j = perm[j] mod n_blocks
                (perm a random permutation of the blocks), masks l ~ U{1..block} of its positions, every
                later position, and each earlier position (earlier blocks and the prompt) with probability p

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
MaskScheme = Literal["uniform", "stratified", "block_random"]


@dataclass
class MaskDraw:
    """Masks of n Monte-Carlo samples: completion [B, n, L] and prompt [B, n, P] (True = masked)."""

    completion: Tensor
    prompt: Tensor


def draw_masks(estimator: Estimator, batch_size: int, n: int, gen_length: int, prompt_length: int,
               prompt_mask_prob: float, generator: torch.Generator, scheme: MaskScheme = "uniform",
               block_length: int | None = None) -> MaskDraw:
    """Draw the masks an estimator uses under a mask scheme (see the module docstring)."""
    B, L, P = batch_size, gen_length, prompt_length
    if estimator == "one_step":
        completion = torch.ones(B, n, L, dtype=torch.bool)
        prompt = torch.rand(B, n, P, generator=generator) < prompt_mask_prob
        return MaskDraw(completion, prompt)
    if estimator not in ("elbo", "coupled"):
        raise ValueError(f"sampler.estimator={estimator!r} must be one of elbo, coupled, one_step")
    if scheme == "block_random":
        return _block_random(B, n, L, P, block_length or L, prompt_mask_prob, generator)
    if scheme == "stratified":
        count = stratified_counts(B, n, L, generator).unsqueeze(-1)
    elif scheme == "uniform":
        count = torch.randint(1, L + 1, (B, n, 1), generator=generator)  # l ~ U{1..L}
    else:
        raise ValueError(f"sampler.mask_scheme={scheme!r} must be one of uniform, stratified, block_random")
    return MaskDraw(_random_positions(count, B, n, L, generator), torch.zeros(B, n, P, dtype=torch.bool))


def stratified_counts(batch_size: int, n: int, gen_length: int, generator: torch.Generator) -> Tensor:
    """Mask counts [B, n]: l_j = ((round(k + j L / n) - 1) mod L) + 1 with one k ~ U{1..L} per sequence."""
    L = gen_length
    k = torch.randint(1, L + 1, (batch_size, 1), generator=generator).double()
    spread = k + torch.arange(n, dtype=torch.float64) * (L / n)
    return (spread.round().long() - 1) % L + 1


def _random_positions(count: Tensor, B: int, n: int, L: int, generator: torch.Generator) -> Tensor:
    """`count` [B, n, 1] positions of each of L, drawn uniformly without replacement: [B, n, L]."""
    rank = torch.rand(B, n, L, generator=generator).argsort(dim=-1).argsort(dim=-1)  # a uniform permutation
    return rank < count


def _block_random(B: int, n: int, L: int, P: int, block: int, p: float, generator: torch.Generator) -> MaskDraw:
    """SPG/StableDRL's block-wise random masks (see the module docstring)."""
    n_blocks = L // block
    perm = torch.rand(B, max(n, n_blocks), generator=generator).argsort(dim=-1)
    chosen = (perm[:, :n] % n_blocks).unsqueeze(-1)  # [B, n, 1]
    pos = torch.arange(L)
    start = chosen * block
    in_block = (pos >= start) & (pos < start + block)
    count = torch.randint(1, block + 1, (B, n, 1), generator=generator)  # l ~ U{1..block}
    rank = torch.rand(B, n, L, generator=generator).masked_fill(~in_block, 2.0).argsort(-1).argsort(-1)
    earlier = (pos < start) & (torch.rand(B, n, L, generator=generator) < p)
    completion = (in_block & (rank < count)) | (pos >= start + block) | earlier
    return MaskDraw(completion, torch.rand(B, n, P, generator=generator) < p)


def guided_logits(model, inputs: Tensor, prompt_length: int, mask_token_id: int, cfg_scale: float = 0.0) -> Tensor:
    """The model's logits [B, S, V]; with classifier-free guidance (w = cfg_scale > 0)

        logits = u + (w + 1) (c - u),    c = model(x),  u = model(x with every prompt position masked)

    in one forward pass over [x; x_uncond] (LLaDA's `get_logits`). The sampler and every estimator call this,
    so samples are scored under the distribution they were drawn from."""
    if cfg_scale == 0:
        return model(inputs).logits
    uncond = inputs.clone()
    uncond[:, :prompt_length] = mask_token_id
    cond, un = model(torch.cat([inputs, uncond])).logits.chunk(2)
    return un + (cfg_scale + 1) * (cond - un)


def token_log_probs(model, prompt: Tensor, completion: Tensor, completion_mask: Tensor, prompt_mask: Tensor,
                    mask_token_id: int, cfg_scale: float = 0.0) -> Tensor:
    """log p(y_i | masked input) [B, L] at every completion position from one (guided) forward pass."""
    inputs = torch.cat([prompt.masked_fill(prompt_mask, mask_token_id),
                        completion.masked_fill(completion_mask, mask_token_id)], dim=1)
    logits = guided_logits(model, inputs, prompt.shape[1], mask_token_id, cfg_scale)[:, prompt.shape[1]:]
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
             mask_token_id: int, reduce: str, cfg_scale: float = 0.0) -> SequenceLogProb:
    """The estimator's value for one MC sample per row; `masks` = (completion [B, L], prompt [B, P]);
    `cfg_scale`: the sampler's classifier-free guidance, applied to every pass (`guided_logits`)."""
    cmask, pmask = (masks.completion, masks.prompt) if isinstance(masks, MaskDraw) else masks
    L = completion.shape[1]
    tok = token_log_probs(model, prompt, completion, cmask, pmask, mask_token_id, cfg_scale)
    if estimator == "coupled":
        partner = torch.where(cmask.all(-1, keepdim=True), cmask, ~cmask)
        tok_partner = token_log_probs(model, prompt, completion, partner, pmask, mask_token_id, cfg_scale)
        value = 0.5 * (masked_estimate(tok, cmask) + masked_estimate(tok_partner, partner))
        tok = torch.where(cmask, tok, tok_partner)  # each token from the pass where it was masked
    else:
        value = masked_estimate(tok, cmask)
    if reduce == "mean":
        value = value / L
    return SequenceLogProb(value, tok, cmask)
