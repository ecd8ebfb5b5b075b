"""Masked-diffusion sampling and likelihood estimators on a tiny random BERT (float64 where exactness is claimed)."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from steadyrl.rollout.arith import ArithTask
from steadyrl.rollout.likelihood import draw_masks, estimate, token_log_probs
from steadyrl.rollout.masked_diffusion import transfer_schedule
from tests.helpers import MASK, arith_prompts, masked_sampler, tiny_lm


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


def test_masks_follow_their_estimator():
    gen = torch.Generator().manual_seed(0)
    elbo = draw_masks("elbo", 2000, 1, 5, 6, 0.15, gen)
    counts = elbo.completion.sum(-1).flatten()
    assert counts.min() >= 1 and counts.max() <= 5 and not elbo.prompt.any()
    freq = torch.bincount(counts, minlength=6)[1:].double() / len(counts)
    assert torch.allclose(freq, torch.full((5,), 0.2, dtype=torch.float64), atol=0.03)  # l ~ U{1..L}
    one = draw_masks("one_step", 2000, 1, 5, 6, 0.15, gen)
    assert one.completion.all() and abs(one.prompt.double().mean() - 0.15) < 0.02


def test_elbo_estimator_is_unbiased_for_the_enumerated_elbo():
    """E[(L/l) sum_{i in M} log p] equals the ELBO summed exactly over every mask (L = 3: 7 masks)."""
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
    for estimator in ("elbo", "coupled"):
        masks = draw_masks(estimator, 2 * n, 1, L, p.shape[1], 0.0, torch.Generator().manual_seed(1))
        vals = estimate(model, estimator, p.repeat(n, 1), y.repeat(n, 1), (masks.completion[:, 0], masks.prompt[:, 0]),
                        MASK, "sum").logp.view(n, 2).T
        se = vals.std(1) / math.sqrt(n)
        assert ((vals.mean(1) - exact).abs() < 4 * se + 1e-9).all(), estimator


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
