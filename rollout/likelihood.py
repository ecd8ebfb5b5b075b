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
  stratified    LLaDA's `get_log_likelihood`: the n MC samples of a sequence in mini-batches of b
                (`sampler.stratified_batch_size`, default b = n); each mini-batch draws one k ~ U{1..L} and
                takes the counts  l_i = ((round(linspace(k, k + (b-1) L / b, b)_i) - 1) mod L) + 1,  i = 0..b-1,
                spread evenly over 1..L (each still uniform on its own), positions uniformly; linspace and
                round in float32 as theirs (`stratified_counts`)
  block_random  SPG/StableDRL: blocks of `block_length`; MC sample j takes block b_j = perm[j] mod n_blocks
                (perm a random permutation of the blocks), masks l ~ U{1..block} of its positions, every
                later position, and each earlier position (earlier blocks and the prompt) with probability p

`reduce="mean"` divides ell by L: for elbo this is the mean log-prob over the masked tokens (the
per-sample form of SPG/StableDRL's code). The masks are drawn at rollout time and stored in the batch,
so the old, new and reference policies see the same masks unless deliberately decoupled.

Padding and EOS (what a real tokenizer's batch looks like):

  prompts   left-padded to one width P; by default the model attends only to the real tokens (attention mask =
            prompt mask + ones over the completion: SPG's `get_logits_spg`, LLaDA's `generate.py`), and a model
            with absolute positions (BERT) gets position ids counted from the first real token, so a padded row
            scores as the same prompt alone would. d1's code does not: diffu-grpo's `get_logits` (the path of
            `_get_per_token_logps`) and `generate` call `model(x)` with no attention mask, so its left-padded
            rows attend to the pad tokens (the tokenizer's prompt mask is made and never passed to the model);
            `sampler.attend_pads: true` reproduces that (the sampler then passes attention=None).
  EOS       (d1's and SPG/StableDRL's completion mask) V = positions up to and including the completion's
            first EOS. Every position after it is masked in the model's input and left out of every term: L, l
            and M above become L_V = |V|, counts l ~ U{1..L_V} (block_random: blocks of the first L_V positions)
            and M & V; `reduce="mean"` divides by L_V. A row without EOS has V = everything.
"""
from __future__ import annotations

import functools
import inspect
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


def prompt_attention(prompt: Tensor, pad_id: int | None) -> Tensor | None:
    """[B, P] True at real prompt tokens: from a row's first non-pad token on (prompts are left-padded).
    None when no row is padded (or there is no pad id): the model is then called without a mask."""
    if pad_id is None:
        return None
    real = (prompt != pad_id).cumsum(dim=1) > 0
    return None if bool(real.all()) else real


def completion_valid(completion: Tensor, eos_id: int | None) -> Tensor | None:
    """V [B, L]: True up to and including the first EOS (a row without one: everywhere); None when
    `eos_id` is None (every position is scored, the fixed-canvas reading)."""
    if eos_id is None:
        return None
    is_eos = completion == eos_id
    return (is_eos.cumsum(dim=1) - is_eos.long()) == 0  # no EOS strictly before position i


def draw_masks(estimator: Estimator, batch_size: int, n: int, gen_length: int, prompt_length: int,
               prompt_mask_prob: float, generator: torch.Generator, scheme: MaskScheme = "uniform",
               block_length: int | None = None, valid: Tensor | None = None,
               stratified_batch: int | None = None) -> MaskDraw:
    """Draw the masks an estimator uses under a mask scheme (see the module docstring); `valid` [B, L]: the
    positions up to the first EOS, the only ones counted and chosen (None: all L); `stratified_batch`: the
    stratified scheme's mini-batch of MC samples sharing one k (None: all n)."""
    B, L, P = batch_size, gen_length, prompt_length
    if estimator == "one_step":
        completion = torch.ones(B, n, L, dtype=torch.bool)
        prompt = torch.rand(B, n, P, generator=generator) < prompt_mask_prob
        return MaskDraw(completion, prompt)
    if estimator not in ("elbo", "coupled"):
        raise ValueError(f"sampler.estimator={estimator!r} must be one of elbo, coupled, one_step")
    if scheme == "block_random":
        return _block_random(B, n, L, P, block_length or L, prompt_mask_prob, generator, valid)
    if scheme == "stratified":
        count = stratified_counts(B, n, L, generator, _lengths(valid), stratified_batch).unsqueeze(-1)
    elif scheme == "uniform":
        if valid is None:
            count = torch.randint(1, L + 1, (B, n, 1), generator=generator)  # l ~ U{1..L}
        else:  # l ~ U{1..L_V}
            count = (torch.rand(B, n, 1, generator=generator, dtype=torch.float64)
                     * _lengths(valid).view(B, 1, 1)).long() + 1
    else:
        raise ValueError(f"sampler.mask_scheme={scheme!r} must be one of uniform, stratified, block_random")
    return MaskDraw(_random_positions(count, B, n, L, generator, valid), torch.zeros(B, n, P, dtype=torch.bool))


def _lengths(valid: Tensor | None) -> Tensor | None:
    """L_V per row [B] (None without EOS handling)."""
    return None if valid is None else valid.sum(dim=-1)


def stratified_counts(batch_size: int, n: int, gen_length: int, generator: torch.Generator,
                      lengths: Tensor | None = None, group: int | None = None) -> Tensor:
    """Mask counts [B, n] as LLaDA's `forward_process`: the n MC samples of a sequence in mini-batches of
    b = `group` (None: one of all n; a shorter last one has b = its size), one k ~ U{1..L} per mini-batch, and
    sample i of it takes

        l_i = ((round(linspace(k, k + (b - 1) (L / b), b)_i) - 1) mod L) + 1

    with their float32 arithmetic: end = f32(k) + f32((b - 1) (L / b)), step = f32(end - k) / (b - 1), and
    linspace_i = k + step i (i < b // 2), end - step (b - 1 - i) (the rest), each a fused multiply-add as
    torch's linspace kernel computes it (one rounding: exact in float64 here, then rounded to float32), round
    half to even. (float64 arithmetic puts some .5 ties on the other side: L = 5, b = 6, k = 5 gives 7.5 at
    i = 3, count 3, where theirs has 7.4999995, count 2.)
    L per row from `lengths` [B] when given (the positions up to the first EOS)."""
    b_max = n if group is None else min(group, n)
    n_groups = -(-n // b_max)
    if lengths is None:
        L = torch.full((batch_size, 1), float(gen_length), dtype=torch.float64)
        k = torch.randint(1, gen_length + 1, (batch_size, n_groups), generator=generator).double()
    else:
        L = lengths.view(batch_size, 1).double()
        k = (torch.rand(batch_size, n_groups, generator=generator, dtype=torch.float64) * L).floor() + 1
    j = torch.arange(n)
    g, i = j // b_max, (j % b_max).double()
    b = (n - g * b_max).clamp(max=b_max).double()  # each sample's mini-batch size
    k = k[:, g]  # [B, n]: the draw of each sample's mini-batch

    def f32(x: Tensor) -> Tensor:
        return x.float().double()

    end = f32(k + f32(L / b * (b - 1)))  # f32 add of f32(k) and the float64 product rounded to f32
    step = f32(f32(end - k) / (b - 1).clamp(min=1))  # b = 1: linspace is [k], step unused
    value = torch.where(i < torch.div(b, 2, rounding_mode="floor"), k + step * i, end - step * (b - 1 - i)).float()
    return ((value.round().double() - 1) % L + 1).long()


def _random_positions(count: Tensor, B: int, n: int, L: int, generator: torch.Generator,
                      valid: Tensor | None = None) -> Tensor:
    """`count` [B, n, 1] positions of each of L (of the `valid` ones), drawn uniformly without replacement."""
    u = torch.rand(B, n, L, generator=generator)
    if valid is not None:
        u = u.masked_fill(~valid.unsqueeze(1), 2.0)  # invalid positions rank last, never chosen
    rank = u.argsort(dim=-1).argsort(dim=-1)  # a uniform permutation
    return rank < count


def _block_random(B: int, n: int, L: int, P: int, block: int, p: float, generator: torch.Generator,
                  valid: Tensor | None = None) -> MaskDraw:
    """SPG/StableDRL's block-wise random masks (see the module docstring); with `valid`, only the blocks the
    completion reaches are chosen and l ~ U{1..positions of the chosen block up to the EOS}."""
    n_blocks = L // block
    lengths = torch.full((B,), L) if valid is None else valid.sum(dim=-1)
    used = ((lengths - 1) // block + 1).clamp(min=1).view(B, 1)  # blocks holding a scored position
    perm = torch.rand(B, max(n, n_blocks), generator=generator).argsort(dim=-1)
    chosen = (perm[:, :n] % used).unsqueeze(-1)  # [B, n, 1]
    pos = torch.arange(L)
    start = chosen * block
    span = (lengths.view(B, 1, 1) - start).clamp(min=1, max=block)  # scored positions of the chosen block
    in_block = (pos >= start) & (pos < start + span)
    if valid is None:
        count = torch.randint(1, block + 1, (B, n, 1), generator=generator)  # l ~ U{1..block}
    else:
        count = (torch.rand(B, n, 1, generator=generator, dtype=torch.float64) * span).long() + 1  # U{1..span}
    rank = torch.rand(B, n, L, generator=generator).masked_fill(~in_block, 2.0).argsort(-1).argsort(-1)
    earlier = (pos < start) & (torch.rand(B, n, L, generator=generator) < p)
    completion = (in_block & (rank < count)) | (pos >= start + block) | earlier
    return MaskDraw(completion, torch.rand(B, n, P, generator=generator) < p)


_WRAPPERS = ("module", "_orig_mod", "net", "policy")  # DeepSpeed, torch.compile, LanguageModelPolicy, AdapterReference


def _takes_position_ids(model) -> bool:
    """Does the model (under DeepSpeed's, torch.compile's, peft's or our policy wrappers) name `position_ids` in
    its forward? BERT does (absolute positions); LLaDA does not (rotary positions only see offsets, so left
    padding under an attention mask needs none)."""
    while True:
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
            continue
        inner = next((m for m in (getattr(model, a, None) for a in _WRAPPERS) if isinstance(m, torch.nn.Module)),
                     None)
        if inner is None:
            return _forward_takes_position_ids(type(model))
        model = inner


@functools.lru_cache(maxsize=None)
def _forward_takes_position_ids(cls: type) -> bool:
    """Once per model class: every padded forward asks."""
    return "position_ids" in inspect.signature(cls.forward).parameters


def model_logits(model, inputs: Tensor, attention: Tensor | None = None) -> Tensor:
    """`model(inputs).logits` [B, S, V]; with a prompt attention mask [B, P] (left padding) the model gets
    attention_mask = [attention | ones] and, where it takes them, position ids counted from the first real
    token (SPG's `get_logits_spg`, plus positions for absolute-position models)."""
    if attention is None:
        return model(inputs).logits
    full = torch.cat([attention, attention.new_ones(len(inputs), inputs.shape[1] - attention.shape[1])], dim=1)
    kwargs = {"attention_mask": full.long()}
    if _takes_position_ids(model):
        kwargs["position_ids"] = (full.long().cumsum(dim=1) - 1).clamp(min=0)
    return model(inputs, **kwargs).logits


def guided_logits(model, inputs: Tensor, prompt_length: int, mask_token_id: int, cfg_scale: float = 0.0,
                  attention: Tensor | None = None) -> Tensor:
    """The model's logits [B, S, V]; with classifier-free guidance (w = cfg_scale > 0)

        logits = u + (w + 1) (c - u),    c = model(x),  u = model(x with every prompt position masked)

    in one forward pass over [x; x_uncond] (LLaDA's `get_logits`), the attention mask duplicated with it. The
    sampler and every estimator call this, so samples are scored under the distribution they were drawn from."""
    if cfg_scale == 0:
        return model_logits(model, inputs, attention)
    uncond = inputs.clone()
    uncond[:, :prompt_length] = mask_token_id
    both = None if attention is None else torch.cat([attention, attention])
    cond, un = model_logits(model, torch.cat([inputs, uncond]), both).chunk(2)
    return un + (cfg_scale + 1) * (cond - un)


def token_log_probs(model, prompt: Tensor, completion: Tensor, completion_mask: Tensor, prompt_mask: Tensor,
                    mask_token_id: int, cfg_scale: float = 0.0, attention: Tensor | None = None,
                    valid: Tensor | None = None) -> Tensor:
    """log p(y_i | masked input) [B, L] at every completion position from one (guided) forward pass; positions
    outside `valid` (after the first EOS) are masked in the input."""
    return token_terms(model, prompt, completion, completion_mask, prompt_mask, mask_token_id, cfg_scale, attention,
                       valid)[0]


def token_terms(model, prompt: Tensor, completion: Tensor, completion_mask: Tensor, prompt_mask: Tensor,
                mask_token_id: int, cfg_scale: float = 0.0, attention: Tensor | None = None,
                valid: Tensor | None = None, entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """`token_log_probs` and, with `entropy`, the per-position entropy [B, L] of the same distribution (`entropy_of`)
    from the same forward pass (None without)."""
    hidden = completion_mask if valid is None else completion_mask | ~valid
    inputs = torch.cat([prompt.masked_fill(prompt_mask, mask_token_id),
                        completion.masked_fill(hidden, mask_token_id)], dim=1)
    logits = guided_logits(model, inputs, prompt.shape[1], mask_token_id, cfg_scale, attention)[:, prompt.shape[1]:]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # a bf16 model's log-probs in float32
    logp = torch.log_softmax(logits, dim=-1)
    tok = logp.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
    return tok, (entropy_of(logp) if entropy else None)


def entropy_of(log_probs: Tensor) -> Tensor:
    """H = -sum_v p_v log p_v over the last (vocabulary) dimension of log-probs [..., V] -> [...], with grad."""
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def mean_over(values: Tensor, positions: Tensor) -> Tensor:
    """sum_{t in S} values_t / max(|S|, 1) per row [B]: the mean of [B, L] `values` over the positions S [B, L]."""
    return (values * positions).sum(dim=-1) / positions.sum(dim=-1).clamp(min=1).to(values.dtype)


def masked_estimate(token_logp: Tensor, mask: Tensor, length: Tensor | int | None = None) -> Tensor:
    """(L / |M|) * sum_{i in M} log p_i per sample [B] (0 where the mask is empty); `length`: L per row
    (L_V under EOS handling; default the mask's width)."""
    L = mask.shape[-1] if length is None else length
    count = mask.sum(-1).clamp(min=1).to(token_logp.dtype)
    return (token_logp * mask).sum(-1) * (L / count)


def k3_kl(new: LogProb, ref: LogProb) -> Tensor:
    """k3 estimate of KL(pi_theta || pi_ref) per sample from sequence log-likelihoods: exp(d) - d - 1,
    d = log pi_ref - log pi_theta (unbiased, never negative)."""
    d = ref.logp - new.logp
    return d.exp() - d - 1


@dataclass
class SequenceLogProb(LogProb):
    """One MC sample's estimate `logp` [B] and what it was built from: per-token log-probs [B, L] of the
    masked positions' pass, the scored mask M & V [B, L], and V [B, L] (positions up to the first EOS): the
    masked-diffusion sampler's `log_prob`."""

    token_logp: Tensor
    mask: Tensor
    valid: Tensor
    # with `log_prob(..., entropy=True)`: each row's mean per-token entropy [B] of the scored distribution over the
    # positions this estimate scores (the sampler says which), with grad; None otherwise
    entropy: Tensor | None = None

    @property
    def lengths(self) -> Tensor:
        """L_V per row [B]: the completion's scored length."""
        return self.valid.sum(dim=-1)


def estimate(model, estimator: Estimator, prompt: Tensor, completion: Tensor, masks: MaskDraw | tuple[Tensor, Tensor],
             mask_token_id: int, reduce: str, cfg_scale: float = 0.0, attention: Tensor | None = None,
             valid: Tensor | None = None, entropy: bool = False) -> SequenceLogProb:
    """The estimator's value for one MC sample per row; `masks` = (completion [B, L], prompt [B, P]);
    `cfg_scale`: the sampler's classifier-free guidance, applied to every pass (`guided_logits`); `attention`
    [B, P]: the prompts' padding mask (None: unpadded); `valid` [B, L]: positions up to the first EOS (None:
    all). With `entropy`, also each row's mean entropy over the scored positions S, from the same passes:
    S = M & V (elbo, one_step), S = (M | M^c) & V = V (coupled, each position's from the pass where it was masked)."""
    cmask, pmask = (masks.completion, masks.prompt) if isinstance(masks, MaskDraw) else masks
    if valid is None:
        valid = torch.ones_like(completion, dtype=torch.bool)
    cmask = cmask & valid
    length = valid.sum(-1)
    tok, ent = token_terms(model, prompt, completion, cmask, pmask, mask_token_id, cfg_scale, attention, valid, entropy)
    scored = cmask
    if estimator == "coupled":
        partner = torch.where((cmask == valid).all(-1, keepdim=True), cmask, ~cmask & valid)
        tok_partner, ent_partner = token_terms(model, prompt, completion, partner, pmask, mask_token_id, cfg_scale,
                                               attention, valid, entropy)
        value = 0.5 * (masked_estimate(tok, cmask, length) + masked_estimate(tok_partner, partner, length))
        tok = torch.where(cmask, tok, tok_partner)  # each token from the pass where it was masked
        ent = None if ent is None else torch.where(cmask, ent, ent_partner)
        scored = cmask | partner
    else:
        value = masked_estimate(tok, cmask, length)
    if reduce == "mean":
        value = value / length
    return SequenceLogProb(value, tok, cmask, valid, None if ent is None else mean_over(ent, scored))
