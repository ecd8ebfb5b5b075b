"""Masked-diffusion sampling and likelihood estimators on a tiny random BERT (float64 where exactness is claimed)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from steadyrl.rollout.arith import ArithTask
from steadyrl.rollout.likelihood import draw_masks, estimate, token_log_probs
from steadyrl.rollout.masked_diffusion import transfer_schedule
from tests.helpers import MASK, after_first_eos, arith_prompts, masked_sampler, tiny_lm


class Recorder(torch.nn.Module):
    """Wraps a model and keeps every input it is called with."""

    def __init__(self, model):
        super().__init__()
        self.model, self.inputs = model, []

    def forward(self, input_ids):
        self.inputs.append(input_ids.clone())
        return self.model(input_ids)


def test_transfer_schedule_spreads_the_remainder_over_the_first_steps():
    assert transfer_schedule(10, 4) == [3, 3, 2, 2]
    for m, s in itertools.product(range(1, 12), range(1, 6)):
        sched = transfer_schedule(m, s)
        assert sum(sched) == m and max(sched) - min(sched) <= 1


def test_greedy_decoding_is_deterministic_and_fills_every_position():
    model, s = tiny_lm(), masked_sampler(temperature=0.0, gen_length=4, num_steps=4)
    a = s.generate(model, arith_prompts(6), torch.Generator().manual_seed(0))
    b = s.generate(model, arith_prompts(6), torch.Generator().manual_seed(123))
    assert torch.equal(a, b) and not (a == MASK).any()


def test_greedy_step_commits_the_most_confident_position_first():
    """One token per step: the first committed token is the argmax over positions of max-softmax."""
    model, s = tiny_lm(1), masked_sampler(temperature=0.0, gen_length=4, num_steps=4)
    p = arith_prompts(3)
    x = torch.cat([p, torch.full((3, 4), MASK)], 1)
    logits = model(x).logits[:, p.shape[1]:].clone()
    logits[..., MASK] = -math.inf
    conf, tok = torch.softmax(logits, -1).max(-1)
    rec = Recorder(model)
    s.generate(rec, p)
    after_first = rec.inputs[1][:, p.shape[1]:]
    first = conf.argmax(-1)
    for r in range(3):
        assert (after_first[r] != MASK).sum() == 1 and after_first[r, first[r]] == tok[r, first[r]]


def test_blocks_decode_left_to_right():
    model, s = tiny_lm(), masked_sampler(temperature=1.0, gen_length=4, block_length=2, num_steps=4)
    rec = Recorder(model)
    s.generate(rec, arith_prompts(5), torch.Generator().manual_seed(0))
    P = arith_prompts(5).shape[1]
    assert len(rec.inputs) == 4
    for step, x in enumerate(rec.inputs):
        comp = x[:, P:]
        if step < 2:  # the second block stays fully masked while the first is decoded
            assert (comp[:, 2:] == MASK).all()
        else:
            assert (comp[:, :2] != MASK).all()


def test_random_remasking_and_guidance_run_the_same_loop():
    model = tiny_lm()
    out = masked_sampler(remasking="random", gen_length=4, num_steps=2).generate(model, arith_prompts(4),
                                                                                 torch.Generator().manual_seed(0))
    assert out.shape == (4, 4) and not (out == MASK).any()
    rec = Recorder(model)
    masked_sampler(cfg_scale=1.5, gen_length=4, num_steps=1, temperature=0.0).generate(rec, arith_prompts(4))
    (x,) = rec.inputs
    P = arith_prompts(4).shape[1]
    assert x.shape[0] == 8 and (x[4:, :P] == MASK).all() and torch.equal(x[:4, :P], arith_prompts(4))


@pytest.mark.parametrize("estimator", ["elbo", "coupled", "one_step"])
def test_float64_recompute_equals_the_rollout_for_any_batch_split(estimator):
    """The ratio invariant: in float64 the learner's recompute of each MC sample's log-likelihood estimate, with
    the rollout's stored masks, equals the rollout's stored value to 1e-9 for micro-batches of 1, 3 and 16."""
    model = tiny_lm()
    s = masked_sampler(estimator=estimator, mc_samples=3, gen_length=4, num_steps=4)
    batch = s.sample(model, arith_prompts(4), 4, torch.Generator().manual_seed(0))
    assert batch.old_logp.shape == (16, 3)
    for size in (1, 3, 16):
        for mb in batch.split(size):
            for j in range(3):
                assert torch.allclose(s.log_prob(model, mb, j).logp, mb.old_logp[:, j],
                                      atol=1e-9, rtol=0)


@pytest.mark.parametrize("estimator", ["elbo", "coupled", "one_step"])
def test_guided_estimators_score_samples_under_the_distribution_the_sampler_drew_them_from(estimator):
    """With cfg_scale = w > 0 every estimator's per-token log-probs are log softmax(u + (w + 1)(c - u)), u the
    pass with the prompt masked (as the sampler guides), not the plain model's; the recompute still equals the
    rollout's stored value. (Positions after a completion's first EOS are masked in the input: `after_first_eos`.)"""
    model = tiny_lm()
    w, P = 0.7, arith_prompts(4).shape[1]
    guided = masked_sampler(estimator=estimator, mc_samples=2, gen_length=4, num_steps=4, cfg_scale=w)
    batch = guided.sample(model, arith_prompts(4), 2, torch.Generator().manual_seed(0))
    cmask, pmask = batch.extras["mc_masks"][:, 0], batch.extras["prompt_masks"][:, 0]
    cmask = cmask & ~after_first_eos(batch.samples)
    hidden = cmask | after_first_eos(batch.samples)
    inputs = torch.cat([batch.cond.masked_fill(pmask, MASK), batch.samples.masked_fill(hidden, MASK)], dim=1)
    uncond = inputs.clone()
    uncond[:, :P] = MASK
    c, u = model(inputs).logits[:, P:], model(uncond).logits[:, P:]
    want = torch.log_softmax(u + (w + 1) * (c - u), -1).gather(-1, batch.samples.unsqueeze(-1)).squeeze(-1)
    got = guided.log_prob(model, batch, 0)
    assert torch.allclose(got.token_logp[cmask], want[cmask], atol=1e-10)
    assert torch.allclose(got.logp, batch.old_logp[:, 0], atol=1e-12)
    plain = masked_sampler(estimator=estimator, mc_samples=2, gen_length=4, num_steps=4).log_prob(model, batch, 0)
    assert (plain.logp - got.logp).abs().max() > 1e-6  # guidance changes the likelihood (float64): it is applied


def test_masks_follow_their_estimator():
    gen = torch.Generator().manual_seed(0)
    elbo = draw_masks("elbo", 2000, 1, 5, 6, 0.15, gen)
    counts = elbo.completion.sum(-1).flatten()
    assert counts.min() >= 1 and counts.max() <= 5 and not elbo.prompt.any()
    freq = torch.bincount(counts, minlength=6)[1:].double() / len(counts)
    assert torch.allclose(freq, torch.full((5,), 0.2, dtype=torch.float64), atol=0.03)  # l ~ U{1..L}
    one = draw_masks("one_step", 2000, 1, 5, 6, 0.15, gen)
    assert one.completion.all() and abs(one.prompt.double().mean() - 0.15) < 0.02


def test_stratified_counts_follow_llada_s_formula_and_are_each_uniform():
    """l_j = ((round(linspace(k, k + (n-1) L/n, n)) - 1) mod L) + 1 (numpy's linspace as the reference), each
    l_j uniform on 1..L over sequences, and the n counts of a sequence distinct when n divides L."""
    import numpy as np

    from steadyrl.rollout.likelihood import stratified_counts

    B, n, L = 4000, 4, 8
    counts = stratified_counts(B, n, L, torch.Generator().manual_seed(3))
    k = torch.randint(1, L + 1, (B, 1), generator=torch.Generator().manual_seed(3)).numpy()
    want = (np.round(np.stack([np.linspace(float(ki), ki + (n - 1) * L / n, n) for ki in k[:, 0]])) - 1) % L + 1
    assert np.array_equal(counts.numpy(), want.astype(np.int64))
    for j in range(n):
        freq = torch.bincount(counts[:, j], minlength=L + 1)[1:].double() / B
        assert torch.allclose(freq, torch.full((L,), 1 / L, dtype=torch.float64), atol=0.025)
    assert all(len(set(row.tolist())) == n for row in counts)


def test_block_random_masks_one_block_partly_every_later_position_and_earlier_ones_with_p():
    """SPG's block-wise masks (blocks of 2 over L = 8): MC sample j's block b_j (a permutation of the blocks
    over j), 1..2 of its positions, every later position; earlier positions and the prompt each with p."""
    B, n, L, P, block, prob = 3000, 4, 8, 5, 2, 0.3
    bare = draw_masks("elbo", B, n, L, P, 0.0, torch.Generator().manual_seed(7), "block_random", block)
    full = draw_masks("elbo", B, n, L, P, prob, torch.Generator().manual_seed(7), "block_random", block)
    assert not bare.prompt.any() and (bare.completion <= full.completion).all()  # same draws, p adds only
    first = bare.completion.int().argmax(-1)  # with p = 0 the first masked position is in the chosen block
    chosen = first // block
    pos = torch.arange(L)
    start = (chosen * block).unsqueeze(-1)
    assert (bare.completion[pos >= start + block]).all() and not bare.completion[pos < start].any()
    in_block = bare.completion & (pos >= start) & (pos < start + block)
    assert ((in_block.sum(-1) >= 1) & (in_block.sum(-1) <= block)).all()
    assert all(sorted(row.tolist()) == [0, 1, 2, 3] for row in chosen)  # n = blocks: each block once
    earlier = full.completion[(pos < start).expand_as(full.completion)]
    assert abs(earlier.double().mean() - prob) < 0.02 and abs(full.prompt.double().mean() - prob) < 0.02


def test_mask_schemes_that_cannot_apply_are_refused_naming_the_setting():
    with pytest.raises(ValueError, match="block_random needs sampler.estimator=elbo"):
        masked_sampler(estimator="coupled", mask_scheme="block_random")
    with pytest.raises(ValueError, match="sampler.mask_scheme=stratified applies to the elbo and coupled"):
        masked_sampler(estimator="one_step", mask_scheme="stratified")


@pytest.mark.parametrize("estimator, scheme", [("elbo", "stratified"), ("coupled", "stratified"),
                                               ("elbo", "block_random")])
def test_every_mask_scheme_keeps_the_recompute_equal_to_the_rollout(estimator, scheme):
    model = tiny_lm()
    s = masked_sampler(estimator=estimator, mask_scheme=scheme, mc_samples=3, gen_length=4, block_length=2,
                       num_steps=4)
    batch = s.sample(model, arith_prompts(4), 4, torch.Generator().manual_seed(0))
    if scheme == "stratified":
        counts = batch.extras["mc_masks"].sum(-1)
        scored = (~after_first_eos(batch.samples)).sum(-1, keepdim=True)  # counts spread over 1..L_V
        assert ((counts >= 1) & (counts <= scored)).all()
        spread = counts.max(1).values > counts.min(1).values
        assert spread[scored.squeeze(1) > 1].all() and (scored > 1).any()
    for mb in batch.split(3):
        for j in range(3):
            assert torch.allclose(s.log_prob(model, mb, j).logp, mb.old_logp[:, j], atol=1e-9, rtol=0)


def test_elbo_estimator_is_unbiased_for_the_enumerated_elbo():
    """E[(L/l) sum_{i in M} log p] equals the ELBO summed exactly over every mask (L = 3: 7 masks), with
    uniform and stratified mask counts."""
    model = tiny_lm(2)
    task = ArithTask(digits=1, gen_length=3)
    p, y = arith_prompts(2), task.encode_completions(task.problems(0, range(2)))
    L = y.shape[1]
    exact = torch.zeros(2, dtype=torch.float64)
    for l in range(1, L + 1):
        subsets = list(itertools.combinations(range(L), l))
        for subset in subsets:
            m = torch.zeros(2, L, dtype=torch.bool)
            m[:, list(subset)] = True
            tok = token_log_probs(model, p, y, m, torch.zeros_like(p, dtype=torch.bool), MASK)
            exact += (1 / L) * (L / l) * (tok * m).sum(-1) / len(subsets)
    n = 3000

    def per_row(estimator: str, completion_masks: torch.Tensor, prompt_masks: torch.Tensor) -> torch.Tensor:
        """`estimate` of row i (prompt i % 2) under its masks, computed once per distinct (prompt, masks) row: the
        value is a function of them alone, and 2 x 7 of them cover the 6000 draws."""
        rows = torch.cat([(torch.arange(2 * n) % 2)[:, None], completion_masks, prompt_masks], 1).long()
        distinct, which = torch.unique(rows, dim=0, return_inverse=True)
        i, cmask, pmask = distinct[:, 0], distinct[:, 1:1 + L].bool(), distinct[:, 1 + L:].bool()
        return estimate(model, estimator, p[i], y[i], (cmask, pmask), MASK, "sum").logp[which]

    for estimator, scheme in (("elbo", "uniform"), ("coupled", "uniform"), ("elbo", "stratified"),
                              ("coupled", "stratified")):
        # 3 MC samples per draw (stratified: spread over them), each unbiased on its own
        masks = draw_masks(estimator, 2 * n, 3, L, p.shape[1], 0.0, torch.Generator().manual_seed(1), scheme)
        vals = sum(per_row(estimator, masks.completion[:, j], masks.prompt[:, j]) for j in range(3)) / 3
        vals = vals.view(n, 2).T
        se = vals.std(1) / math.sqrt(n)
        assert ((vals.mean(1) - exact).abs() < 4 * se + 1e-9).all(), (estimator, scheme)


def test_coupled_pairs_mask_every_token_exactly_once():
    model = tiny_lm()
    p = arith_prompts(3)
    y = torch.randint(3, 13, (3, 4))
    masks = draw_masks("coupled", 3, 1, 4, p.shape[1], 0.0, torch.Generator().manual_seed(0))
    m = masks.completion[:, 0]
    full = m.all(-1, keepdim=True)
    partner = torch.where(full, m, ~m)
    assert ((m ^ partner) | full).all()  # disjoint and covering, unless l = L (then both are the full mask)
    seq = estimate(model, "coupled", p, y, (m, masks.prompt[:, 0]), MASK, "sum")
    a = token_log_probs(model, p, y, m, masks.prompt[:, 0], MASK)
    b = token_log_probs(model, p, y, partner, masks.prompt[:, 0], MASK)
    want = 0.5 * ((a * m).sum(-1) * 4 / m.sum(-1) + (b * partner).sum(-1) * 4 / partner.sum(-1))
    assert torch.allclose(seq.logp, want, atol=1e-12)


def test_independent_masks_are_redrawn_for_the_new_policy_and_kept_for_the_old():
    model = tiny_lm()
    s = masked_sampler(masks="independent", mc_samples=2, gen_length=4, num_steps=4)
    batch = s.sample(model, arith_prompts(4), 4, torch.Generator().manual_seed(0))
    fresh = s.with_fresh_masks(batch, torch.Generator().manual_seed(5))
    assert torch.equal(fresh.samples, batch.samples) and torch.equal(fresh.old_logp, batch.old_logp)
    assert not torch.equal(fresh.extras["mc_masks"], batch.extras["mc_masks"])
    assert torch.allclose(s.log_prob(model, batch, 0).logp, batch.old_logp[:, 0], atol=1e-12)
    assert not torch.allclose(s.log_prob(model, fresh, 0).logp, batch.old_logp[:, 0])


def test_k3_kl_is_zero_on_equal_likelihoods_and_positive_otherwise():
    from steadyrl.rollout.sampler import LogProb

    s = masked_sampler()
    new = LogProb(torch.tensor([-2.0, -3.0, -1.0], dtype=torch.float64))
    ref = LogProb(torch.tensor([-2.0, -2.5, -4.0], dtype=torch.float64))
    kl = s.kl(new, ref)
    d = ref.logp - new.logp
    assert kl[0] == 0 and (kl[1:] > 0).all() and torch.allclose(kl, d.exp() - d - 1)
