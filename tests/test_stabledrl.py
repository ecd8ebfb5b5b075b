"""StableDRL: the paper form (clip + self-normalisation) and the official-code form (capped softmax weights).

The objectives are driven exactly as the learner drives them (`prepare` over every piece of an optimisation
step, then `loss` per piece, losses summed) on a linear toy policy: term j has log pi_j(theta) = g_j . theta + b_j,
so grad log pi_j = g_j is known and every gradient can be checked against a closed-form reference.
"""
from __future__ import annotations

import math

import pytest
import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig, UNetConfig
from steadyrl.rollout.models import build_scheduler, build_class_policy
from steadyrl.services.config import ConfigError, load_config
from steadyrl.trainer.objectives import TermInputs, build_objective
from steadyrl.trainer.objectives.grpo import GRPOSettings
from steadyrl.trainer.objectives.stabledrl_code import StableDRLCodeSettings
from steadyrl.trainer.objectives.stabledrl_paper import StableDRLPaperSettings

F64 = torch.float64
TINY = UNetConfig(block_out_channels=(8, 16), norm_num_groups=4)


class ToyStep:
    """One optimisation step: `n_samples` samples in micro-batches of `micro`, `n_steps` trained steps each.

    Term (sample i, step k) has log pi = g[i,k] . theta + b[i,k] and old log pi = that - log_ratio[i,k].
    Pieces are (micro-batch, step slot) pairs in the learner's order; rows index samples in the step.
    """

    def __init__(self, n_samples=12, micro=4, n_steps=3, dim=5, log_ratio=None, adv=None, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.theta = torch.randn(dim, generator=gen, dtype=F64, requires_grad=True)
        self.g = torch.randn(n_samples, n_steps, dim, generator=gen, dtype=F64)
        self.b = torch.randn(n_samples, n_steps, generator=gen, dtype=F64)
        self.log_ratio = (torch.randn(n_samples, n_steps, generator=gen, dtype=F64) * 0.1
                          if log_ratio is None else log_ratio.to(F64))
        self.adv = torch.randn(n_samples, generator=gen, dtype=F64) if adv is None else adv.to(F64)
        self.micro, self.n_steps, self.n_samples = micro, n_steps, n_samples
        self.pieces = [(torch.arange(s, min(s + micro, n_samples)), k)
                       for s in range(0, n_samples, micro) for k in range(n_steps)]

    def new_logp(self, rows, k):
        return self.g[rows, k] @ self.theta + self.b[rows, k]

    def run(self, obj):
        """prepare + sum of per-piece losses, as the learner's per-step path (trainer/terms.py `PerStepTerms`);
        returns (grad wrt theta, stats, metrics)."""
        self.theta.grad = None
        n_terms = self.n_samples * self.n_steps
        stats = {}
        if obj.needs_prepare:
            stats = obj.prepare([TermInputs(
                new_logp=self.new_logp(rows, k).detach(), old_logp=self._old(rows, k), advantages=self.adv[rows],
                step=torch.full((len(rows),), k), std=torch.ones(len(rows), dtype=F64),
                dt=torch.ones(len(rows), dtype=F64), n_terms=n_terms, rows=rows) for rows, k in self.pieces])
        metrics = []
        for rows, k in self.pieces:
            loss, m = obj.loss(self.inputs(rows, k, n_terms), stats)
            loss.backward()
            metrics.append(m)
        return self.theta.grad.clone(), stats, metrics

    def inputs(self, rows, k, n_terms):
        return TermInputs(new_logp=self.new_logp(rows, k), old_logp=self._old(rows, k), advantages=self.adv[rows],
                          step=torch.full((len(rows),), k), std=torch.ones(len(rows), dtype=F64),
                          dt=torch.ones(len(rows), dtype=F64), n_terms=n_terms, rows=rows)

    def _old(self, rows, k):
        return (self.new_logp(rows, k) - self.log_ratio[rows, k]).detach()


def paper(**kw):
    return build_objective(StableDRLPaperSettings(**kw))


def code(**kw):
    return build_objective(StableDRLCodeSettings(**kw))


# ---------------------------------------------------------------- paper form
@pytest.mark.parametrize("normalise", ["step", "local"])
def test_paper_update_is_a_convex_combination_even_with_heavy_tailed_ratios(normalise):
    """||grad|| <= max_j |A_j| ||grad log pi_j|| for eps < 1, whatever the ratios (Cauchy log-ratios, with inf)."""
    cauchy = torch.distributions.Cauchy(0.0, 3.0)
    unnormalised_breaks = 0
    for seed in range(40):
        torch.manual_seed(seed)
        log_ratio = cauchy.sample((12, 3)).to(F64)
        log_ratio[0, 0], log_ratio[1, 1] = 800.0, -800.0  # exp overflows to inf / underflows to 0
        adv = torch.distributions.StudentT(2.0).sample((12,)).to(F64)
        toy = ToyStep(log_ratio=log_ratio, adv=adv, seed=seed)
        eps = [0.2, 0.5, 0.9][seed % 3]
        grad, _, _ = toy.run(paper(eps_clip=eps, normalise=normalise))
        bound = (adv[:, None].abs() * toy.g.norm(dim=-1)).max()
        assert torch.isfinite(grad).all()
        assert grad.norm() <= bound * (1 + 1e-12), (seed, float(grad.norm()), float(bound))
        # the same terms without self-normalisation (a plain sum of c_j A_j g_j) break the bound: the check has teeth
        c = log_ratio.exp().clamp(1 - eps, 1 + eps)
        unnormalised_breaks += int((c * adv[:, None])[..., None].mul(toy.g).sum((0, 1)).norm() > bound)
    assert unnormalised_breaks >= 20


def test_paper_gradient_matches_the_self_normalised_reference():
    toy = ToyStep(log_ratio=torch.randn(12, 3, generator=torch.Generator().manual_seed(1)) * 0.5)
    eps = 0.2
    grad, stats, metrics = toy.run(paper(eps_clip=eps))
    c = toy.log_ratio.exp().clamp(1 - eps, 1 + eps)
    w = c / c.sum()
    expected = -(w * toy.adv[:, None])[..., None].mul(toy.g).sum((0, 1))
    assert torch.allclose(grad, expected, atol=1e-12)
    assert float(stats["stabledrl/c_sum"]) == pytest.approx(float(c.sum()), rel=1e-12)
    assert float(metrics[0]["stabledrl/norm"]) == pytest.approx(float(c.mean()), rel=1e-12)
    assert max(float(m["stabledrl/weight_max"]) for m in metrics) == pytest.approx(float(w.max()), rel=1e-12)
    assert 0 < float(w.min()) and float(c.max()) <= 1 + eps and float(c.min()) >= 1 - eps


def test_paper_at_ratio_one_is_the_mean_advantage_policy_gradient_and_matches_grpo():
    toy = ToyStep(log_ratio=torch.zeros(12, 3))
    n = 12 * 3
    grad, _, metrics = toy.run(paper(eps_clip=0.2))
    expected = -(toy.adv[:, None, None] * toy.g).sum((0, 1)) / n
    assert torch.allclose(grad, expected, atol=1e-14, rtol=0)
    grpo_grad, _, _ = toy.run(build_objective(GRPOSettings(eps_clip=0.2)))
    assert torch.allclose(grad, grpo_grad, atol=1e-14, rtol=0)
    assert all(float(m["stabledrl/norm"]) == 1.0 for m in metrics)
    assert all(float(m["stabledrl/weight_max"]) == pytest.approx(1 / n, rel=1e-14) for m in metrics)


def test_paper_step_and_local_normalisation_agree_on_one_piece_and_differ_on_several():
    log_ratio = torch.randn(4, 1, generator=torch.Generator().manual_seed(2)) * 0.3
    one = ToyStep(n_samples=4, micro=4, n_steps=1, log_ratio=log_ratio)
    assert len(one.pieces) == 1
    g_step, _, _ = one.run(paper(eps_clip=0.5, normalise="step"))
    g_local, _, _ = one.run(paper(eps_clip=0.5, normalise="local"))
    assert torch.allclose(g_step, g_local, atol=1e-14)

    many = ToyStep(log_ratio=torch.randn(12, 3, generator=torch.Generator().manual_seed(3)) * 0.3)
    g_step, _, _ = many.run(paper(eps_clip=0.5, normalise="step"))
    g_local, _, _ = many.run(paper(eps_clip=0.5, normalise="local"))
    assert (g_step - g_local).norm() > 1e-3 * g_step.norm()
    # local: each piece self-normalised, weighted by its share of the step's terms
    c = many.log_ratio.exp().clamp(0.5, 1.5)
    n_terms = 12 * 3
    expected = torch.zeros_like(g_local)
    for rows, k in many.pieces:
        w = c[rows, k] / c[rows, k].sum() * len(rows) / n_terms
        expected -= (w * many.adv[rows])[:, None].mul(many.g[rows, k]).sum(0)
    assert torch.allclose(g_local, expected, atol=1e-12)


def test_paper_eps_clip_must_stay_below_one():
    with pytest.raises(ValueError, match="eps_clip"):
        StableDRLPaperSettings(eps_clip=1.0)


# ---------------------------------------------------------------- code form
def reference_code_weights(log_ratio, cap):
    """softmax over samples of min(sum over the sample's steps of log rho, cap), by hand."""
    per_sample = [min(sum(float(x) for x in row), cap) for row in log_ratio]
    m = max(per_sample)
    e = [math.exp(x - m) for x in per_sample]
    return torch.tensor([x / sum(e) for x in e], dtype=F64)


def test_code_weights_are_a_softmax_of_the_capped_per_sample_log_ratio_and_are_detached():
    log_ratio = torch.randn(12, 3, generator=torch.Generator().manual_seed(4), dtype=F64)
    log_ratio[2] = torch.tensor([3.0, 2.0, 1.0])  # summed 6 > log 5: capped
    toy = ToyStep(log_ratio=log_ratio)
    obj = code()
    grad, stats, metrics = toy.run(obj)
    w = reference_code_weights(log_ratio, math.log(5))
    assert torch.allclose(stats["stabledrl/weights"], w, atol=1e-14)
    assert torch.allclose(stats["stabledrl/log_ratio"], log_ratio.sum(1), atol=1e-14)
    assert not stats["stabledrl/weights"].requires_grad
    # L = -sum_i w_i A_i sum_k log pi_ik: the gradient has no term through w (w depends on log pi too)
    expected = -(w * toy.adv)[:, None, None].mul(toy.g).sum((0, 1))
    assert torch.allclose(grad, expected, atol=1e-12)
    # per term: d loss / d log pi_ik = -w_i A_i exactly
    rows, k = toy.pieces[0]
    lp = toy.new_logp(rows, k).detach().requires_grad_(True)
    inputs = toy.inputs(rows, k, 36)
    inputs.new_logp = lp
    obj.loss(inputs, stats)[0].backward()
    assert torch.allclose(lp.grad, -(w * toy.adv)[rows], atol=1e-14)
    capped = float((log_ratio.sum(1) > math.log(5)).double().mean())
    assert 0 < capped < 1 and float(metrics[0]["stabledrl/cap_frac"]) == pytest.approx(capped)


def test_code_cap_binds_above_only():
    sums = torch.tensor([8.0, 20.0, 0.0, -30.0, math.log(5) - 0.1], dtype=F64)
    toy = ToyStep(n_samples=5, micro=2, n_steps=1, log_ratio=sums[:, None])
    _, stats, _ = toy.run(code())
    w = stats["stabledrl/weights"]
    assert float(w[0]) == float(w[1])  # both above the cap: equal weight
    assert float(w[0] / w[2]) == pytest.approx(5.0, rel=1e-12)  # capped at log 5
    assert float(w[3] / w[2]) == pytest.approx(math.exp(-30), rel=1e-9)  # not floored below
    assert float(w[4] / w[2]) == pytest.approx(5 * math.exp(-0.1), rel=1e-12)  # just under the cap: untouched
    _, stats, _ = toy.run(code(log_ratio_cap=1.0))
    assert float(stats["stabledrl/weights"][0] / stats["stabledrl/weights"][2]) == pytest.approx(math.e, rel=1e-12)


def scored(rewards, group):
    n = len(rewards)
    return RolloutBatch(cond=group.clone(), group=group, samples=torch.zeros(n, 1), traj=torch.zeros(n, 2, 1),
                        old_logp=torch.zeros(n, 1), timesteps=torch.tensor([1]), trainable=torch.tensor([True]),
                        rewards=rewards[:, None], reward_names=["r"], reward_key="r")


def test_code_advantages_are_group_mean_centred_without_std_division_or_clip():
    r = torch.tensor([0.0, 10.0, 20.0, 30.0, 1.0, 1.0, 1.0, 5.0], dtype=F64)
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    batch, _ = code().prepare_batch(scored(r, group))
    expected = torch.cat([r[:4] - r[:4].mean(), r[4:] - r[4:].mean()])
    assert torch.allclose(batch.advantages, expected, atol=1e-12)
    assert float(batch.advantages.abs().max()) == 15.0  # no std division, no clip at 5 (GRPO's adv_clip)
    scaled, _ = code().prepare_batch(scored(10 * r, group))
    assert torch.allclose(scaled.advantages, 10 * expected, atol=1e-10)  # not scale-invariant
    clipped, _ = code(adv_clip=2.0).prepare_batch(scored(r, group))
    assert torch.allclose(clipped.advantages, expected.clamp(-2, 2))


# ---------------------------------------------------------------- config
def test_a_bad_objective_key_fails_at_config_load_naming_the_field():
    with pytest.raises(ConfigError, match=r"objective\.nope"):
        load_config(None, ["objective.name=stabledrl.paper", "objective.nope=1"])
    with pytest.raises(ConfigError, match=r"objective\.eps_clip"):  # the code form has no ratio clip
        load_config(None, ["objective.name=stabledrl.code", "objective.eps_clip=0.2"])
    with pytest.raises(ConfigError, match=r"objective\.normalise"):
        load_config(None, ["objective.name=stabledrl.paper", "objective.normalise=global"])
    cfg = load_config(None, ["objective.name=stabledrl.paper", "objective.normalise=local", "objective.eps_clip=0.3"])
    assert isinstance(cfg.objective, StableDRLPaperSettings) and cfg.objective.normalise == "local"


# ---------------------------------------------------------------- the real learner
@pytest.fixture(scope="module", params=["stabledrl.paper", "stabledrl.code"])
def learner(request):
    from steadyrl.rollout.ddim import DDIMLogProbSampler
    from steadyrl.services.runtime.ray_session import free_port, set_rank_env
    from steadyrl.trainer.config import LearnerConfig

    set_rank_env(free_port())
    from steadyrl.trainer.builders import build_deepspeed_learner

    torch.manual_seed(0)
    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=5), build_scheduler(SchedulerConfig()))
    settings = StableDRLPaperSettings() if request.param == "stabledrl.paper" else StableDRLCodeSettings()
    return build_deepspeed_learner(build_class_policy(TINY), sampler, settings,
                                   LearnerConfig(lr=1e-3, micro_batch_size=8, optim_batch_size=16, inner_epochs=1),
                                   seed=0)


def scored_batch(learner, reward_fn, seed):
    policy = build_class_policy(TINY)
    policy.load_trainable_state_dict(learner.weights())
    b = learner.sampler.sample(policy, torch.arange(4), 6, torch.Generator().manual_seed(seed))
    return b.replace(rewards=reward_fn(b.samples)[:, None], reward_names=["r"], reward_key="r")


def test_learner_update_moves_the_policy_towards_higher_reward(learner):
    """Reward = mean pixel brightness; a few updates of either form make fresh samples brighter."""
    bright = lambda x: x.mean(dim=(1, 2, 3))  # noqa: E731
    start = float(bright(scored_batch(learner, bright, seed=100).samples).mean())
    for i in range(2):
        m = learner.update(scored_batch(learner, bright, seed=i))
        assert m["policy/optimizer_steps"] == 2 and m["policy/grad_norm"] > 0  # 24 samples: steps of 16 and 8
        assert 0 < m["stabledrl/weight_max"] <= 1.0
    end = float(bright(scored_batch(learner, bright, seed=100).samples).mean())
    assert end > start + 0.08, (learner.objective.name, start, end)  # sign-flipped objectives: < +0.04
