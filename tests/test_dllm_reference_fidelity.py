"""Two dLLM likelihood details reproduced as the authors' code has them (issue 37, items 6 and 7).

d1 on padded prompts: dllm-reasoning/d1's diffu-grpo calls `model(input).logits` with no attention mask
(`get_logits`, the path of `_get_per_token_logps`; `generate` likewise), so its left-padded prompt rows attend
to the pad tokens. `sampler.attend_pads: true` reproduces that; the default masks the pads.

LLaDA's stratified counts: ML-GSAI/LLaDA's `get_log_likelihood.py` `forward_process` draws one k per mini-batch
of `batch_size` MC samples and spreads the counts with a float32 `torch.linspace`; `stratified_counts` must give
their counts cell by cell (`sampler.stratified_batch_size` = their batch_size).

The references below are written from the authors' lines, not from steadyrl's functions.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.likelihood import completion_valid, stratified_counts
from tests.assets.tiny_llada import build_tiny_llada
from tests.helpers import MASK, masked_sampler, tiny_lm

PAD, EOS = TOKENIZER.pad_id, TOKENIZER.eos_id
PROMPTS = ["7+45=", "07+45=", "123+4=", "1+2=", "0|12="]  # 4 to 6 tokens: rows 0, 3 and 4 left-padded to 6


def llada_style():
    return build_tiny_llada(seed=0, vocab_size=len(TOKENIZER), d_model=32, n_layers=2, n_heads=4,
                            mask_token_id=MASK).double()


MODELS = {"bert-position-ids": tiny_lm, "llada-rotary-attention-mask": llada_style}


def left_padded(texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch [N, P] left-padded as d1's tokenizer call (padding_side="left") and which rows hold a pad."""
    rows = [TOKENIZER.encode(t) for t in texts]
    width = max(map(len, rows))
    return torch.tensor([[PAD] * (width - len(r)) + r for r in rows]), torch.tensor([len(r) < width for r in rows])


# ------------------------------------------------------------------------------------------ d1 reference
def d1_per_token_logps(model, prompt: torch.Tensor, completion: torch.Tensor, prompt_masked: torch.Tensor,
                       mask_id: int, cfg_scale: float) -> torch.Tensor:
    """diffu-grpo's `_get_per_token_logps` for one iteration (d1 837888f, diffu_grpo_trainer.py:241-361), with
    its `forward_process` draw given as `prompt_masked` [B, P]: every completion token masked, prompt tokens
    where drawn; `get_logits` calls `model(input).logits` with NO attention mask (its guidance copy masks every
    prompt position); the log-probs are -cross_entropy of the completion logits."""
    input_ids = torch.cat([prompt, completion], dim=1)
    batch_size, seq_len = input_ids.shape
    logits_to_keep = completion.size(1)
    prompt_index = torch.zeros(seq_len, dtype=torch.bool)
    prompt_index[:seq_len - logits_to_keep] = True
    random_draw = torch.cat([prompt_masked, torch.zeros_like(completion, dtype=torch.bool)], dim=1)
    is_mask = (prompt_index & random_draw) | ~prompt_index
    batch = torch.where(is_mask, mask_id, input_ids)
    if cfg_scale > 0.0:
        index = prompt_index.unsqueeze(0).repeat(batch.shape[0], 1)
        un_batch = batch.clone()
        un_batch[index] = mask_id
        batch = torch.cat([batch, un_batch])
    logits = model(batch).logits
    if cfg_scale > 0.0:
        logits, un_logits = torch.chunk(logits, 2, dim=0)
        logits = un_logits + (cfg_scale + 1) * (logits - un_logits)
    completion_logits = logits[:, -logits_to_keep:, :]
    loss = F.cross_entropy(completion_logits.reshape(-1, completion_logits.size(-1)), completion.reshape(-1),
                           reduction="none")
    return -loss.view(batch_size, logits_to_keep)


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("cfg_scale", [0.0, 0.5])
@torch.no_grad()
def test_attend_pads_scores_per_token_log_probs_as_d1_s_code_without_an_attention_mask(model_name, cfg_scale):
    """grpo.d1's per-token log-probs (the one-step estimator) under `attend_pads` equal d1's computation; the
    masked default differs from them on the padded rows and equals them on the unpadded ones (float64)."""
    model = MODELS[model_name]()
    prompts, padded = left_padded(PROMPTS)
    assert padded.any() and not padded.all()
    kw = dict(estimator="one_step", prompt_mask_prob=0.3, mc_samples=2, gen_length=4, block_length=2, num_steps=4,
              cfg_scale=cfg_scale, temperature=1.0)
    d1_like, default = masked_sampler(attend_pads=True, **kw), masked_sampler(**kw)
    batch = d1_like.sample(model, prompts, 1, torch.Generator().manual_seed(0))
    for j in range(2):
        want = d1_per_token_logps(model, batch.cond, batch.samples, batch.extras["prompt_masks"][:, j], MASK,
                                  cfg_scale)
        got = d1_like.log_prob(model, batch, j).token_logp
        masked = default.log_prob(model, batch, j).token_logp
        assert (got - want).abs().max() < 1e-12
        gap = (masked - want).abs().amax(dim=1)
        assert (gap[padded] > 1e-6).all()  # the pads move every padded row's log-probs
        assert (gap[~padded] < 1e-12).all()  # an unpadded row has no pad to attend to


class CallRecorder(torch.nn.Module):
    """The wrapped model, recording the keyword arguments of every call."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.inner = model
        self.calls: list[set[str]] = []

    def forward(self, input_ids, **kwargs):
        self.calls.append(set(kwargs))
        return self.inner(input_ids, **kwargs)


@torch.no_grad()
def test_attend_pads_calls_the_model_without_an_attention_mask_in_generation_and_scoring():
    """d1's `generate` and `get_logits` call `model(x)`: under `attend_pads` no call gets an attention mask, where
    the default passes one for a padded batch."""
    prompts, _ = left_padded(PROMPTS)
    kw = dict(estimator="one_step", mc_samples=2, gen_length=4, block_length=2, num_steps=4)
    for attend_pads, wants_mask in ((True, False), (False, True)):
        model = CallRecorder(llada_style())
        masked_sampler(attend_pads=attend_pads, **kw).sample(model, prompts, 1, torch.Generator().manual_seed(0))
        assert len(model.calls) == 4 + 2  # num_steps generation passes + one pass per MC sample's old_logp
        assert all(("attention_mask" in c) == wants_mask for c in model.calls), (attend_pads, model.calls)


# ------------------------------------------------------------------------------------- LLaDA reference
@functools.lru_cache(maxsize=None)
def llada_counts_list(k: int, target_len: int, b: int) -> list[int]:
    """LLaDA's `forward_process` counts (ML-GSAI/LLaDA b7e6c35, get_log_likelihood.py:11-14) for a drawn k, as
    they write them: k a 0-dim int64 tensor, linspace in torch's default float32."""
    k = torch.tensor(k)
    x = torch.round(torch.linspace(float(k), k + (b - 1) * (target_len / b), steps=b)).long()
    x = ((x - 1) % target_len) + 1
    return x.tolist()


def llada_counts(k: int, target_len: int, b: int) -> torch.Tensor:
    return torch.tensor(llada_counts_list(k, target_len, b))


def float64_counts(k: int, L: int, b: int) -> torch.Tensor:
    """The same spread in float64 (steadyrl's former arithmetic), to show which cells a .5 tie flips."""
    spread = k + torch.arange(b, dtype=torch.float64) * (L / b)
    return ((spread.round() - 1) % L + 1).long()


def check_against_llada(counts: torch.Tensor, lengths: list[int], b: int) -> set[tuple[int, int]]:
    """Every mini-batch of b samples of every row equals LLaDA's counts for its k (its first count: linspace
    starts at k exactly) and the row's L; returns the (L, k) seen."""
    seen = set()
    for row, L in zip(counts.tolist(), lengths):
        for g in range(0, len(row), b):
            k = row[g]
            assert 1 <= k <= L
            assert row[g:g + b] == llada_counts_list(k, L, b), (L, b, k, row[g:g + b])
            seen.add((L, k))
    return seen


@pytest.mark.parametrize("b", [1, 2, 3, 5, 6, 7, 10, 12, 16, 18, 20, 24, 31, 32, 48, 64, 128])
def test_stratified_counts_agree_with_llada_s_float32_linspace_cell_by_cell(b):
    """For L = 1..40, 50, 64, 100, 128, 256 and every k = 1..L: one k per b samples, the b counts LLaDA's lines
    give (n = 2b: two mini-batches per row)."""
    for L in [*range(1, 41), 50, 64, 100, 128, 256]:
        B = 30 * L  # enough rows that every k in 1..L is drawn
        counts = stratified_counts(B, 2 * b, L, torch.Generator().manual_seed(L), group=b)
        seen = check_against_llada(counts, [L] * B, b)
        assert {k for _, k in seen} == set(range(1, L + 1)), (L, b)


def test_the_l5_batch6_k5_tie_lands_where_llada_s_float32_puts_it():
    """L = 5, b = 6, k = 5: k + 3 L / b = 7.5 exactly in float64 (rounds to 8: count 3), 7.4999995 in their
    float32 linspace (count 2)."""
    assert llada_counts(5, 5, 6).tolist() == [5, 1, 2, 2, 3, 4]
    assert float64_counts(5, 5, 6)[3] == 3  # the tie is real: float64 lands on the other side
    counts = stratified_counts(400, 6, 5, torch.Generator().manual_seed(0), group=6)
    rows = counts[counts[:, 0] == 5]
    assert len(rows) > 0 and (rows == torch.tensor([5, 1, 2, 2, 3, 4])).all()


def test_float32_changes_some_cells_against_float64():
    """The sweep has cells where float32 and float64 disagree (so the cell-by-cell test can fail)."""
    flipped = [(L, b, k) for L in range(1, 41) for b in range(1, 41) for k in range(1, L + 1)
               if not torch.equal(llada_counts(k, L, b), float64_counts(k, L, b))]
    assert (5, 6, 5) in flipped and len(flipped) > 10


def test_one_k_per_batch_size_samples():
    """n = 12 samples in mini-batches of 4: each mini-batch spreads its own k over 1..L with b = 4 (not 12), and
    the mini-batches of a row draw their k independently."""
    L, n, b = 9, 12, 4
    counts = stratified_counts(2000, n, L, torch.Generator().manual_seed(1), group=b)
    check_against_llada(counts, [L] * len(counts), b)
    ks = counts[:, ::b]  # [B, 3]: each mini-batch's k
    assert (ks[:, 0] != ks[:, 1]).float().mean() > 0.8  # independent draws: equal with probability 1/9
    for g in range(n // b):  # each k ~ U{1..L}
        freq = torch.bincount(ks[:, g], minlength=L + 1)[1:].double() / len(ks)
        assert torch.allclose(freq, torch.full((L,), 1 / L, dtype=torch.float64), atol=0.03)
    whole = stratified_counts(2000, n, L, torch.Generator().manual_seed(1))  # default: one k for all n samples
    check_against_llada(whole, [L] * len(whole), n)


def test_stratified_counts_under_eos_use_each_row_s_length_as_llada_s_target_len():
    """With an EOS, a row's L is its scored length L_V: the counts are LLaDA's with target_len = L_V."""
    gen = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 13, (3000,), generator=gen)
    counts = stratified_counts(len(lengths), 12, 12, gen, lengths, group=6)
    seen = check_against_llada(counts, lengths.tolist(), 6)
    assert {L for L, _ in seen} == set(range(1, 13))


def test_the_sampler_draws_stratified_masks_in_mini_batches_of_stratified_batch_size():
    """`sampler.stratified_batch_size` reaches the masks: their counts per mini-batch are LLaDA's, within each
    row's positions up to its EOS."""
    sampler = masked_sampler(mask_scheme="stratified", mc_samples=8, stratified_batch_size=4, gen_length=6,
                             block_length=6, num_steps=6)
    completion = torch.randint(0, 10, (400, 6), generator=torch.Generator().manual_seed(0))
    completion[::3, 2] = EOS
    valid = completion_valid(completion, EOS)
    masks = sampler.draw_masks(len(completion), 3, torch.Generator().manual_seed(4), valid)
    assert not (masks.completion & ~valid.unsqueeze(1)).any()
    check_against_llada(masks.completion.sum(-1), valid.sum(-1).tolist(), 4)


def test_stratified_batch_size_is_refused_where_it_cannot_apply():
    with pytest.raises(ValidationError, match="stratified_batch_size=3 must divide sampler.mc_samples=8"):
        masked_sampler(mask_scheme="stratified", mc_samples=8, stratified_batch_size=3)
    with pytest.raises(ValidationError, match="stratified_batch_size=4 applies to mask_scheme=stratified"):
        masked_sampler(mask_scheme="uniform", mc_samples=8, stratified_batch_size=4)
