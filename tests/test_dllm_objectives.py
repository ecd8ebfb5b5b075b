"""Objectives on MC-estimated sequence likelihoods: BGPO's bound and the learner's two-pass exact pieces."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.trainer.objectives.base import TermInputs
from steadyrl.trainer.objectives.bgpo import BGPOPaper, BGPOPaperSettings, bgpo_bound
from tests.helpers import after_first_eos, arith_prompts, masked_sampler, tiny_lm


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    set_rank_env(free_port())


def rollout(model, n_mc=4, seed=0):
    s = masked_sampler(mc_samples=n_mc, gen_length=4, num_steps=4)
    batch = s.sample(model, arith_prompts(3), 4, torch.Generator().manual_seed(seed))
    adv = torch.randn(len(batch), generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return s, batch.replace(advantages=adv)


def grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def exact_objective(model, s, batch) -> torch.Tensor:
    """mean_i A_i exp(mean_j ell_j - mean_j ell_j^old): the MC-ratio objective in one graph (the naive form)."""
    n = batch.old_logp.shape[1]
    new = torch.stack([s.log_prob(model, batch, j).logp for j in range(n)], 1)
    return (batch.advantages * (new.mean(1) - batch.old_logp.mean(1)).exp()).mean()


def bgpo_loss_by_pieces(model, s, batch) -> float:
    """BGPOPaper.loss over one piece per MC sample, each back-propagated in turn (as the learner does)."""
    obj, n, total = BGPOPaper(BGPOPaperSettings()), batch.old_logp.shape[1], 0.0
    for j in range(n):
        new = s.log_prob(model, batch, j).logp
        inputs = TermInputs(new_logp=new, old_logp=batch.old_logp[:, j], advantages=batch.advantages,
                            step=torch.full((len(batch),), j), n_terms=len(batch) * n)  # no Gaussian std / dt
        loss, _ = obj.loss(inputs, {})
        loss.backward()
        total += loss.item()
    return total


def test_bgpo_bound_equals_the_exact_objective_in_value_and_gradient_on_policy():
    model = tiny_lm()
    s, batch = rollout(model)
    exact = exact_objective(model, s, batch)
    (-exact).backward()
    g_exact = grads(model)
    model.zero_grad()
    value = bgpo_loss_by_pieces(model, s, batch)
    assert value == pytest.approx(-exact.item(), abs=1e-12)
    assert torch.allclose(grads(model), g_exact, atol=1e-12, rtol=1e-9)


def test_bgpo_bound_is_a_lower_bound_off_policy():
    model = tiny_lm()
    s, batch = rollout(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        new = torch.stack([s.log_prob(model, batch, j).logp for j in range(4)], 1)
    delta = new - batch.old_logp
    bound = bgpo_bound(delta, batch.advantages.unsqueeze(1)).mean(1)
    exact = batch.advantages * delta.mean(1).exp()
    assert (delta.abs() > 1e-3).any() and (bound <= exact + 1e-12).all()


def test_the_learners_two_pass_pieces_give_the_single_graph_gradient():
    """GRPO on a sequence-level sampler: n backward passes (one per MC sample) give the gradient of
    -mean_i A_i rho_i, rho_i = exp(mean_j ell_j - mean_j ell_j^old), computed in one graph."""
    from steadyrl.trainer.builders import build_deepspeed_learner
    from steadyrl.trainer.config import LearnerConfig
    from steadyrl.trainer.objectives.grpo import GRPOSettings

    model = tiny_lm(dtype=torch.float32)
    s, batch = rollout(model)
    batch = batch.replace(advantages=None, old_logp=batch.old_logp.float(),
                          rewards=batch.advantages.float().unsqueeze(1), reward_names=["r"], reward_key="r")
    reference = tiny_lm(dtype=torch.float32)
    learner = build_deepspeed_learner(tiny_lm(dtype=torch.float32), s, GRPOSettings(eps_clip=0.5),
                                      LearnerConfig(micro_batch_size=4, optim_batch_size=12, inner_epochs=1,
                                                    grad_clip=1e9))
    prepared, _ = learner.objective.prepare_batch(batch)
    loss = -(prepared.advantages * (torch.stack([s.log_prob(reference, prepared, j).logp for j in range(4)], 1).mean(1)
                                    - prepared.old_logp.mean(1)).exp()).mean()
    loss.backward()
    want = float(grads(reference).norm())
    metrics = learner.update(batch)
    assert metrics["policy/rollout_logp_absdiff_max"] < 1e-5
    assert learner._pre_clip_norm == pytest.approx(want, rel=1e-4)


def test_grpo_on_masked_diffusion_raises_the_reward_of_a_token():
    """A few learner updates with the reward 'completion starts with digit 1' make it more likely. The learner's
    KL monitor is the k3 estimate of KL(pi_theta || pi_ref) on the sequence estimates: mean_i exp(r_i) - r_i - 1,
    r_i = log pi_ref(y_i) - log pi_theta(y_i), each log pi the mean over the batch's MC mask samples, pi_ref the
    initial policy (GRPO never resets it) -- recomputed here in float64 numpy from the two models' log-probs."""
    from steadyrl.trainer.builders import build_deepspeed_learner
    from steadyrl.trainer.config import LearnerConfig
    from steadyrl.trainer.objectives.grpo import GRPOSettings

    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    learner = build_deepspeed_learner(tiny_lm(dtype=torch.float32), s, GRPOSettings(eps_clip=0.2, kl_coef=0.01),
                                      LearnerConfig(lr=3e-3, micro_batch_size=16, inner_epochs=1))
    reference = tiny_lm(dtype=torch.float32)  # the weights the learner started from
    one = TOKENIZER.encode("1")[0]

    def current_policy():
        policy = tiny_lm(dtype=torch.float32)
        policy.load_state_dict(learner.weights())
        return policy

    def batch(seed):
        b = s.sample(current_policy(), arith_prompts(8, seed), 8, torch.Generator().manual_seed(seed))
        r = (b.samples[:, 0] == one).float()
        return b.replace(rewards=r.unsqueeze(1), reward_names=["r"], reward_key="r")

    def k3_of_sequence_estimates(b) -> float:
        with torch.no_grad():
            ell = [np.mean([s.log_prob(model, b, j).logp.double().numpy() for j in range(2)], axis=0)
                   for model in (reference, current_policy())]
        r = ell[0] - ell[1]
        return float(np.mean(np.exp(r) - r - 1))

    start = float(batch(100).rewards.mean())
    for i in range(8):
        b = batch(i)
        want = k3_of_sequence_estimates(b)
        m = learner.update(b)
        assert "policy/kl_ref" in m
        if i == 0:  # the policy is the reference: both log-probs are the same computation, the KL exactly 0
            assert want == 0.0 and m["policy/kl_ref_monitor"] == 0.0
        else:
            assert m["policy/kl_ref_monitor"] == pytest.approx(want, rel=1e-3, abs=1e-7), i
    assert want > 1e-3  # the policy has moved away from the reference: the comparison above is not 0 == 0
    assert float(batch(100).rewards.mean()) > start + 0.2


def test_eubo_pieces_sum_to_the_one_graph_eubo_gradient():
    """SPG's EUBO is a log of a mean over MC samples; its per-sample pieces' gradients sum to its own."""
    from steadyrl.trainer.objectives.sandwich import eubo_piece, eubo_statistics

    model = tiny_lm()
    s, batch = rollout(model)
    samples = [s.log_prob(model, batch, j) for j in range(4)]
    q, eubo = eubo_statistics(samples, 1.5)
    # the definition, written out (their code): over the positions V up to the first EOS, t_j = |m_j & V| / |V|,
    # q_i = mean_j p_ij^beta (m_ij & V_i) / t_j; EUBO = mean_{i: q_i > 0} log q_i / beta
    valid = ~after_first_eos(batch.samples)
    assert (~valid).any()  # some completion ends early: V matters here
    t = [(smp.mask & valid).double().sum(-1, keepdim=True) / valid.sum(-1, keepdim=True) for smp in samples]
    q_ref = sum(smp.token_logp.exp() ** 1.5 * (smp.mask & valid) / tj for smp, tj in zip(samples, t)) / 4
    eubo_ref = torch.stack([row[row > 0].log().mean() / 1.5 for row in q_ref])
    assert torch.allclose(q, q_ref, atol=1e-12) and torch.allclose(eubo, eubo_ref, atol=1e-12)
    (-eubo.sum()).backward()
    g_one = grads(model)
    model.zero_grad()
    with torch.no_grad():
        q, eubo = eubo_statistics([s.log_prob(model, batch, j) for j in range(4)], 1.5)
    for j in range(4):
        piece = eubo_piece(s.log_prob(model, batch, j), q, eubo, 1.5, 4)
        assert torch.allclose(piece.detach(), eubo, atol=1e-12)
        (-piece.sum()).backward()
    assert torch.allclose(grads(model), g_one, atol=1e-12, rtol=1e-9)


def test_stabledrl_code_sandwich_through_the_learner_matches_one_graph():
    """stabledrl.code on a dLLM: -sum_i w_i A_i J_i, J the SPG sandwich, w softmax within each group."""
    from steadyrl.trainer.builders import build_deepspeed_learner
    from steadyrl.trainer.config import LearnerConfig
    from steadyrl.trainer.objectives.sandwich import eubo_statistics, sandwich
    from steadyrl.trainer.objectives.stabledrl_code import StableDRLCodeSettings

    model = tiny_lm(dtype=torch.float32)
    s, batch = rollout(model)
    batch = batch.replace(advantages=None, old_logp=batch.old_logp.float(),
                          rewards=batch.advantages.float().unsqueeze(1), reward_names=["r"], reward_key="r")
    cfg = StableDRLCodeSettings(softmax_over="group")
    learner = build_deepspeed_learner(tiny_lm(dtype=torch.float32), s, cfg,
                                      LearnerConfig(micro_batch_size=4, optim_batch_size=12, inner_epochs=1,
                                                    grad_clip=1e9))
    prepared, _ = learner.objective.prepare_batch(batch)
    reference = tiny_lm(dtype=torch.float32)
    passes = [s.log_prob(reference, prepared, j) for j in range(4)]
    elbo = torch.stack([p.logp for p in passes], 1).mean(1)
    _, eubo = eubo_statistics(passes, cfg.eubo_beta)
    w = torch.full((12,), 1 / 4 / 3)  # on policy: log rho = 0, uniform within each of the 3 groups of 4
    loss = -(w * prepared.advantages * sandwich(elbo, eubo, prepared.advantages, cfg.eubo_mix)).sum()
    loss.backward()
    assert (prepared.advantages <= 0).any() and (prepared.advantages > 0).any()
    learner.update(batch)
    assert learner._pre_clip_norm == pytest.approx(float(grads(reference).norm()), rel=1e-4)


def test_eubo_ignores_tokens_no_mask_covers_in_float32():
    """A token masked in no MC sample has q = 0: it is left out (their code), never log(0) or 0/0."""
    from steadyrl.rollout.likelihood import SequenceLogProb
    from steadyrl.trainer.objectives.sandwich import eubo_piece, eubo_statistics

    logp = torch.log(torch.tensor([[0.5, 0.25, 0.9]])).requires_grad_(True)
    mask = torch.tensor([[True, True, False]])
    sample = SequenceLogProb(logp.sum(-1), logp, mask, torch.ones_like(mask))
    q, eubo = eubo_statistics([sample], 1.5)
    t = 2 / 3
    want = (torch.log(torch.tensor(0.5 ** 1.5 / t)) + torch.log(torch.tensor(0.25 ** 1.5 / t))) / 2 / 1.5
    assert q[0, 2] == 0 and torch.allclose(eubo, want.view(1))
    eubo_piece(sample, q.detach(), eubo.detach(), 1.5, 1).sum().backward()
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0
