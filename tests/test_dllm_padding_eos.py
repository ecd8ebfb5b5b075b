"""Batches as a real tokenizer makes them: left-padded prompts of different lengths, completions that end early.

Padding: a padded row must generate and score exactly as its prompt alone does (the attention mask, and position
ids for absolute-position models), on both model routes: BERT (position ids) and the LLaDA-style model (rotary
positions, attention mask only). EOS: positions after a completion's first EOS are masked in the input and left
out of every likelihood term, mask count and EUBO rate (d1's and SPG/StableDRL's completion mask).
"""
from __future__ import annotations

import pytest
import torch

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import MaskedDiffusionSamplerConfig
from steadyrl.rollout.likelihood import completion_valid, draw_masks, estimate, prompt_attention
from steadyrl.rollout.masked_diffusion import MaskedDiffusionSampler
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from tests.assets.tiny_llada import build_tiny_llada
from tests.helpers import MASK, after_first_eos, masked_sampler, tiny_lm

PAD, EOS = TOKENIZER.pad_id, TOKENIZER.eos_id
PROMPTS = ["7+45=", "07+45=", "123+4=", "1+2=", "0|12="]  # 4 to 6 tokens: padded to 6


def llada_style():
    return build_tiny_llada(seed=0, vocab_size=len(TOKENIZER), d_model=32, n_layers=2, n_heads=4,
                            mask_token_id=MASK).double()


MODELS = {"bert-position-ids": tiny_lm, "llada-rotary-attention-mask": llada_style}


def encode(texts: list[str]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The left-padded batch [N, P] and each prompt alone [1, P_i]."""
    rows = [TOKENIZER.encode(t) for t in texts]
    width = max(map(len, rows))
    padded = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    return padded, [torch.tensor([r]) for r in rows]


def alone(batch: RolloutBatch, row: int, prompt: torch.Tensor) -> RolloutBatch:
    """Row `row` of a padded batch with its prompt unpadded (and the prompt masks cut to the real tokens)."""
    one = batch.index([row])
    cut = batch.cond.shape[1] - prompt.shape[1]
    return one.replace(cond=prompt).with_extras(prompt_masks=one.extras["prompt_masks"][:, :, cut:])


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("cfg_scale", [0.0, 0.5])
def test_a_padded_row_generates_the_tokens_of_its_prompt_alone(model_name, cfg_scale):
    model = MODELS[model_name]()
    with torch.no_grad():  # weights x 20: a random model's greedy output then depends on its prompt
        for p in model.parameters():
            p.mul_(20 if p.dim() == 2 else 1)
    padded, singles = encode(PROMPTS)
    sampler = masked_sampler(temperature=0.0, gen_length=4, block_length=2, num_steps=4, cfg_scale=cfg_scale)
    together = sampler.generate(model, padded)
    for r, prompt in enumerate(singles):
        assert torch.equal(together[r], sampler.generate(model, prompt)[0]), PROMPTS[r]
    unmasked = MaskedDiffusionSampler(sampler.cfg, MASK, EOS, pad_token_id=None)  # pads attended to
    assert not torch.equal(unmasked.generate(model, padded), together)  # the pads would change the tokens


@pytest.mark.parametrize("model_name", list(MODELS))
@pytest.mark.parametrize("estimator, scheme, cfg_scale", [("elbo", "uniform", 0.0), ("elbo", "block_random", 0.5),
                                                          ("coupled", "stratified", 0.0), ("one_step", "uniform", 0.5)])
@torch.no_grad()
def test_a_padded_row_scores_the_log_likelihood_of_its_prompt_alone(model_name, estimator, scheme, cfg_scale):
    """Every MC sample's estimate of a padded row equals the unpadded prompt's, with the same masks (float64)."""
    model = MODELS[model_name]()
    padded, singles = encode(PROMPTS)
    sampler = masked_sampler(estimator=estimator, mask_scheme=scheme, mc_samples=3, gen_length=4, block_length=2,
                             num_steps=4, cfg_scale=cfg_scale, prompt_mask_prob=0.3)
    batch = sampler.sample(model, padded, 1, torch.Generator().manual_seed(0))
    worst, unmasked_gap = 0.0, 0.0
    unmasked = MaskedDiffusionSampler(sampler.cfg, MASK, EOS, pad_token_id=None)
    for r, prompt in enumerate(singles):
        one = alone(batch, r, prompt.detach())
        for j in range(3):
            got = sampler.log_prob(model, one, j)
            worst = max(worst, float((got.logp - batch.old_logp[r, j]).abs()))
            unmasked_gap = max(unmasked_gap, float((unmasked.log_prob(model, batch.index([r]), j).logp
                                                    - got.logp).abs()))
    print(f"{model_name} {estimator}/{scheme} cfg={cfg_scale}: worst |padded - alone| = {worst:.2e}, "
          f"without the attention mask {unmasked_gap:.2e}")
    assert worst < 1e-12
    assert unmasked_gap > 1e-6  # the comparison has teeth: attending to the pads changes the likelihood


def test_prompt_attention_marks_the_real_tokens_of_left_padded_rows():
    padded, singles = encode(PROMPTS)
    attention = prompt_attention(padded, PAD)
    assert attention.sum(1).tolist() == [s.shape[1] for s in singles]
    assert prompt_attention(singles[0], PAD) is None and prompt_attention(padded, None) is None


# ------------------------------------------------------------------------------------------------ EOS
def early_eos_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts [4, 6] and completions [4, 6]: EOS at 1, at 3 (then junk), first (then junk), none."""
    d = {c: TOKENIZER.encode(c)[0] for c in "0123456789"}
    completions = torch.tensor([[d["5"], EOS, EOS, EOS, EOS, EOS],
                                [d["1"], d["2"], d["3"], EOS, d["7"], d["7"]],
                                [EOS, d["4"], EOS, d["9"], d["9"], d["9"]],
                                [d["1"], d["2"], d["3"], d["4"], d["5"], d["6"]]])
    prompts, _ = encode(["07+45=", "11+12=", "00+00=", "99+99="])
    return prompts, completions


def test_completion_valid_keeps_positions_up_to_and_including_the_first_eos():
    _, completions = early_eos_batch()
    assert torch.equal(completion_valid(completions, EOS), ~after_first_eos(completions))
    assert completion_valid(completions, EOS).sum(1).tolist() == [2, 4, 1, 6]
    assert completion_valid(completions, None) is None


@pytest.mark.parametrize("estimator", ["elbo", "coupled", "one_step"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_tokens_after_the_first_eos_never_move_the_likelihood(estimator, reduce):
    """Rewriting every token after the first EOS leaves each estimate bitwise unchanged; scoring the whole canvas
    (score_after_eos) does not."""
    model = tiny_lm()
    prompts, completions = early_eos_batch()
    valid = completion_valid(completions, EOS)
    masks = draw_masks(estimator, 4, 1, 6, 6, 0.2, torch.Generator().manual_seed(0), valid=valid)
    m = (masks.completion[:, 0], masks.prompt[:, 0])
    rewritten = torch.where(valid, completions, torch.randint(3, len(TOKENIZER), completions.shape,
                                                              generator=torch.Generator().manual_seed(1)))
    assert not torch.equal(rewritten, completions)
    kept = [estimate(model, estimator, prompts, c, m, MASK, reduce, valid=valid) for c in (completions, rewritten)]
    assert torch.equal(kept[0].logp, kept[1].logp)
    canvas = [estimate(model, estimator, prompts, c, m, MASK, reduce) for c in (completions, rewritten)]
    assert not torch.equal(canvas[0].logp, canvas[1].logp)


def test_the_elbo_over_an_early_eos_is_the_reference_codes_masked_mean():
    """SPG's per-sample ELBO: sum_i logp_i m_i v_i / sum_i m_i v_i, post-EOS positions masked in the input;
    our `sum` form is that mean times L_V (the scored length), our `mean` form is the mean itself."""
    model = tiny_lm()
    prompts, completions = early_eos_batch()
    valid = ~after_first_eos(completions)
    masks = draw_masks("elbo", 4, 1, 6, 6, 0.0, torch.Generator().manual_seed(3), valid=valid)
    m = masks.completion[:, 0]
    inputs = torch.cat([prompts, completions.masked_fill(m | ~valid, MASK)], dim=1)
    logp = torch.log_softmax(model(inputs).logits[:, 6:], -1).gather(-1, completions.unsqueeze(-1)).squeeze(-1)
    their_mean = (logp * m * valid).sum(1) / (m & valid).sum(1)
    got_sum = estimate(model, "elbo", prompts, completions, (m, masks.prompt[:, 0]), MASK, "sum", valid=valid)
    got_mean = estimate(model, "elbo", prompts, completions, (m, masks.prompt[:, 0]), MASK, "mean", valid=valid)
    torch.testing.assert_close(got_mean.logp, their_mean, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_sum.logp, their_mean * valid.sum(1), rtol=0, atol=1e-12)
    assert torch.equal(got_sum.mask, m & valid) and torch.equal(got_sum.lengths, valid.sum(1))


@pytest.mark.parametrize("scheme", ["uniform", "stratified", "block_random"])
def test_mask_counts_and_positions_stay_within_the_completion_up_to_its_eos(scheme):
    """Counts are drawn from 1..L_V and only positions up to the first EOS are chosen (their `random` and
    `block_random` forward processes); uniform: each count equally likely."""
    _, completions = early_eos_batch()
    valid = completion_valid(completions, EOS).repeat(500, 1)
    masks = draw_masks("elbo", len(valid), 4, 6, 6, 0.0, torch.Generator().manual_seed(0), scheme, 2, valid)
    chosen = masks.completion & valid.unsqueeze(1)
    assert (chosen.sum(-1) >= 1).all()
    if scheme != "block_random":  # block_random masks every later position too (then left out by V)
        assert not (masks.completion & ~valid.unsqueeze(1)).any()
    if scheme == "uniform":
        counts = chosen.sum(-1)[1::4].flatten()  # the row with L_V = 4
        freq = torch.bincount(counts, minlength=5)[1:].double() / len(counts)
        assert (freq - 0.25).abs().max() < 0.04
    if scheme == "block_random":  # the L_V = 1 row: block 0, its one scored position
        assert chosen[2::4].sum(-1).eq(1).all()


def test_the_eubo_rate_counts_only_positions_up_to_the_eos():
    """t_j = |m_j & V| / |V| (their empirical_t): a completion of L_V = 2 with one masked token has t = 1/2."""
    from steadyrl.rollout.likelihood import SequenceLogProb
    from steadyrl.trainer.objectives.sandwich import eubo_statistics

    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9, 0.9]], dtype=torch.float64))
    valid = torch.tensor([[True, True, False, False]])
    mask = torch.tensor([[True, False, False, False]])
    q, eubo = eubo_statistics([SequenceLogProb(logp.sum(-1), logp, mask, valid)], 1.5)
    assert float(q[0, 0]) == pytest.approx(0.5 ** 1.5 / 0.5) and (q[0, 1:] == 0).all()
    assert float(eubo[0]) == pytest.approx(torch.log(torch.tensor(0.5 ** 1.5 / 0.5)).item() / 1.5)


def test_the_reward_reads_the_completion_up_to_its_first_eos():
    from steadyrl.reward.verifiers import VerifierReward

    prompts, _ = encode(["07+45="])
    right = torch.tensor([TOKENIZER.encode("52") + [EOS, TOKENIZER.encode("9")[0]]])
    wrong = torch.tensor([TOKENIZER.encode("529") + [EOS]])
    verifier = VerifierReward()
    assert verifier.score(right, prompts).item() == 1.0 and verifier.score(wrong, prompts).item() == 0.0


# --------------------------------------------------------------------------------------- the learner
@pytest.fixture(scope="module")
def single_rank():
    set_rank_env(free_port())


def test_the_learner_recomputes_a_padded_early_eos_batch_exactly(single_rank):
    """Through the DeepSpeed learner's sequence path and the reference policy: on policy the recomputed
    likelihoods equal the rollout's (the recompute alarm reads 0) and KL(policy || reference) is 0."""
    from steadyrl.trainer.builders import build_deepspeed_learner
    from steadyrl.trainer.config import LearnerConfig
    from steadyrl.trainer.objectives.stabledrl_code import StableDRLCodeSettings

    padded, _ = encode(PROMPTS)
    sampler = masked_sampler(mc_samples=2, gen_length=4, num_steps=4, logp_reduce="sum")
    batch = sampler.sample(tiny_lm(dtype=torch.float32), padded, 3, torch.Generator().manual_seed(0))
    assert (~completion_valid(batch.samples, EOS)).any() and prompt_attention(batch.cond, PAD) is not None
    rewards = torch.arange(len(batch), dtype=torch.float32).remainder(3).unsqueeze(1)
    batch = batch.replace(rewards=rewards, reward_names=["r"], reward_key="r")
    learner = build_deepspeed_learner(tiny_lm(dtype=torch.float32), sampler, StableDRLCodeSettings(kl_coef=0.01),
                                      LearnerConfig(micro_batch_size=5, optim_batch_size=15, inner_epochs=1))
    metrics = learner.update(batch)
    print(f"padded early-EOS batch, float32 learner recompute: worst |recomputed - rollout| = "
          f"{metrics['policy/rollout_logp_absdiff_max']:.2e}, KL monitor {metrics['policy/kl_ref_monitor']:.2e}")
    assert metrics["policy/rollout_logp_absdiff_max"] < 1e-5
    assert abs(metrics["policy/kl_ref_monitor"]) < 1e-6


# ------------------------------------------------------------------------------------------ bad input
def test_a_sampler_without_an_eos_id_names_the_setting():
    cfg = MaskedDiffusionSamplerConfig()
    with pytest.raises(ValueError, match="testbed.eos_token_id.*score_after_eos"):
        MaskedDiffusionSampler(cfg, MASK)
    MaskedDiffusionSampler(cfg.model_copy(update={"score_after_eos": True}), MASK)  # the whole canvas: no EOS needed
    with pytest.raises(ValueError, match="mask token id must differ"):
        MaskedDiffusionSampler(cfg, MASK, EOS, pad_token_id=MASK)


def test_token_ids_for_the_character_tokenizer_are_refused():
    from steadyrl.services.testbeds.arith.masked import ArithSettings

    with pytest.raises(ValueError, match="testbed.eos_token_id applies to a pretrained model"):
        ArithSettings(eos_token_id=5)
