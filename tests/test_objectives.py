"""Exact properties of the GRPO objective, advantages and the Gaussian KL."""
from __future__ import annotations

import pytest
import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.advantages import group_advantages
from steadyrl.trainer.kl import gaussian_kl_same_std
from steadyrl.trainer.objectives import TermInputs, UpdateSchedule, available, build_objective, objective_class
from steadyrl.trainer.objectives.grpo import GRPOSettings, ppo_clip_loss


def test_group_advantages_use_population_std_within_groups():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 20.0], dtype=torch.float64)
    g = torch.tensor([0, 0, 0, 1, 1, 1])
    adv = group_advantages(r, g, eps_std=1e-4)
    for grp in (0, 1):
        x = r[g == grp]
        expected = (x - x.mean()) / (x.std(unbiased=False) + 1e-4)
        assert torch.allclose(adv[g == grp], expected, atol=1e-12)
        assert abs(float(adv[g == grp].sum())) < 1e-9
    # a constant group has zero advantage, not NaN
    assert torch.equal(group_advantages(torch.ones(4), torch.zeros(4, dtype=torch.long), 1e-4), torch.zeros(4))


def test_ppo_clip_blocks_gradient_beyond_the_clip_range_only_in_the_improving_direction():
    eps = 0.2
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0])
    ppo_clip_loss(ratio, adv, eps).sum().backward()
    # A>0 & rho>1+eps: clipped (no grad); A<0 & rho>1+eps: unclipped (grad -A); A<0 & rho<1-eps: clipped;
    # A>0 & rho<1-eps: unclipped (grad -A); inside the range: grad -A
    assert ratio.grad.tolist() == [0.0, 1.0, 0.0, -1.0, -1.0]


def test_grpo_loss_at_ratio_one_is_minus_mean_advantage_and_kl_adds_linearly():
    obj = build_objective(GRPOSettings(eps_clip=0.1, kl_coef=0.5))
    lp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    adv = torch.tensor([1.0, -0.5, 2.0])
    loss, m = obj.loss(TermInputs(new_logp=lp, old_logp=lp.detach(), advantages=adv, step=torch.zeros(3, dtype=torch.long),
                                  std=torch.ones(3), dt=torch.ones(3), n_terms=3,
                                  kl_ref=torch.tensor([0.2, 0.4, 0.0])), {})
    assert loss.item() == pytest.approx(-adv.mean().item() + 0.5 * 0.2)
    loss.backward()
    assert torch.allclose(lp.grad, -adv / 3)  # d/dlogp of -A*exp(lp - lp_old) at ratio 1
    assert float(m["policy/clip_frac"]) == 0.0 and float(m["policy/ratio_mean"]) == 1.0


@pytest.mark.parametrize("name", ["grpo", "bgpo.paper"])
def test_the_kl_schedules_factor_scales_exactly_the_kl_term_of_every_objective(name):
    """The KL factor the learner's schedule gives an update (`begin_update`) multiplies the KL term and nothing else: the loss at
    scale s minus the loss at scale 0 is s times the loss at scale 1 minus the loss at scale 0."""
    from steadyrl.trainer.objectives.registry import settings_types

    obj = build_objective(settings_types()[name](kl_coef=0.5))
    lp = torch.tensor([-1.0, -2.0, -3.0])

    def loss(scale: float) -> float:
        obj.begin_update(UpdateSchedule(kl_scale=scale))
        inputs = TermInputs(new_logp=lp, old_logp=lp - 0.01, advantages=torch.tensor([1.0, -0.5, 2.0]),
                            step=torch.zeros(3, dtype=torch.long), std=torch.ones(3), dt=torch.ones(3), n_terms=3,
                            kl_ref=torch.tensor([0.2, 0.4, 0.1]), rows=torch.arange(3))
        return float(obj.loss(inputs, {})[0])

    base, one, three = loss(0.0), loss(1.0), loss(3.0)
    assert one != base and three - base == pytest.approx(3 * (one - base), rel=1e-6)
    assert obj.kl_weight == pytest.approx(1.5)


def test_advantages_come_from_the_named_training_reward_column():
    batch = RolloutBatch(cond=torch.zeros(4, dtype=torch.long), group=torch.tensor([0, 0, 1, 1]),
                         samples=torch.zeros(4, 1), traj=torch.zeros(4, 2, 1), old_logp=torch.zeros(4, 1),
                         timesteps=torch.tensor([1]), trainable=torch.tensor([True]),
                         rewards=torch.tensor([[0.0, 1.0], [0.0, 3.0], [5.0, 0.0], [7.0, 0.0]]),
                         reward_names=["a", "b"], reward_key="b")
    adv = build_objective(GRPOSettings()).advantages(batch)
    assert adv[0] < 0 < adv[1] and adv[2] == 0 and adv[3] == 0


def test_unknown_objective_names_the_choices():
    assert "grpo" in available()
    with pytest.raises(ValueError, match="objective.name='nope'.*grpo"):
        objective_class("nope")


def test_analytic_gaussian_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mp, mq = torch.randn(3, 1, 4, 4, generator=g, dtype=torch.float64), torch.randn(3, 1, 4, 4, generator=g,
                                                                                   dtype=torch.float64)
    std = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    s = std.view(-1, 1, 1, 1).expand_as(mp)
    ref = torch.distributions.kl_divergence(torch.distributions.Normal(mp, s), torch.distributions.Normal(mq, s))
    assert torch.allclose(gaussian_kl_same_std(mp, mq, std, "sum"), ref.sum(dim=(1, 2, 3)), atol=1e-10)
    assert torch.allclose(gaussian_kl_same_std(mp, mq, std, "mean"), ref.mean(dim=(1, 2, 3)), atol=1e-12)


def test_batch_split_index_concat_round_trip():
    n = 7
    batch = RolloutBatch(cond=torch.arange(n), group=torch.arange(n) // 2, samples=torch.randn(n, 1, 8, 8),
                         traj=torch.randn(n, 3, 1, 8, 8), old_logp=torch.randn(n, 2), timesteps=torch.tensor([5, 0]),
                         trainable=torch.tensor([True, False]))
    parts = batch.split(3)
    assert [len(p) for p in parts] == [3, 3, 1]
    joined = RolloutBatch.concat(parts)
    assert torch.equal(joined.traj, batch.traj) and torch.equal(joined.cond, batch.cond)
    with pytest.raises(ValueError, match="no rewards"):
        batch.train_reward()
    with pytest.raises(ValueError, match="micro_batch_size"):
        batch.split(0)


def test_group_offset_keeps_groups_of_joined_worker_batches_apart():
    from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig, UNetConfig
    from steadyrl.rollout.ddim import DDIMLogProbSampler
    from steadyrl.rollout.models import build_scheduler, build_class_policy

    model = build_class_policy(UNetConfig(block_out_channels=(8, 16), norm_num_groups=4))
    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=3), build_scheduler(SchedulerConfig()))
    g = torch.Generator().manual_seed(0)
    a = sampler.sample(model, torch.tensor([0, 1]), 2, g, group_offset=0)
    b = sampler.sample(model, torch.tensor([2, 3]), 2, g, group_offset=2)
    joined = RolloutBatch.concat([a, b])
    assert joined.group.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
