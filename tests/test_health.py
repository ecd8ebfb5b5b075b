"""The training-health panel's statistics (trainer/health.py) against numpy and a loop."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.health import (advantage_panel, drop_nonfinite_advantages, quantile_metrics, reward_panel,
                                     zero_std_group_fraction)


def batch(advantages: torch.Tensor, rewards: torch.Tensor | None = None) -> RolloutBatch:
    n = len(advantages)
    return RolloutBatch(cond=torch.arange(n), group=torch.arange(n) // 2, samples=torch.zeros(n, 1),
                        traj=torch.zeros(n, 2, 1), old_logp=torch.zeros(n, 1), timesteps=torch.arange(1),
                        trainable=torch.ones(1, dtype=torch.bool), advantages=advantages, rewards=rewards,
                        reward_names=[] if rewards is None else ["a", "b"],
                        reward_key=None if rewards is None else "a")


def test_quantiles_are_numpys_linear_ones_over_the_finite_entries():
    x = torch.tensor([3.0, -1.0, float("nan"), 7.5, 2.0, float("inf"), 0.25])
    finite = np.array([3.0, -1.0, 7.5, 2.0, 0.25])
    m = quantile_metrics("q", x)
    assert m == {f"q_p{p}": pytest.approx(float(np.quantile(finite, p / 100))) for p in (10, 50, 90)}
    assert quantile_metrics("q", torch.tensor([math.nan])) == {}


def test_every_reward_model_gets_its_own_quantiles_and_advantages_their_std():
    rewards = torch.tensor([[0.0, 10.0], [1.0, 20.0], [2.0, 30.0], [3.0, 40.0]])
    m = reward_panel(batch(torch.zeros(4), rewards))
    assert m["health/reward_a_p50"] == pytest.approx(1.5) and m["health/reward_b_p90"] == pytest.approx(37.0)
    adv = torch.tensor([[1.0, -1.0], [0.5, 0.5], [-2.0, 0.0]])
    assert advantage_panel(adv)["health/adv_std"] == pytest.approx(float(adv.numpy().std()))
    assert advantage_panel(None) == {}


def test_zero_std_groups_are_those_whose_rewards_are_all_equal():
    reward = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 3])  # group 3 has one sample: trivially alike
    assert zero_std_group_fraction(reward, group) == 3 / 4


@pytest.mark.parametrize("shape", ["per_sample", "per_step"])
def test_samples_with_any_nonfinite_advantage_are_dropped_and_counted(shape):
    adv = torch.tensor([1.0, math.nan, -1.0, math.inf])
    if shape == "per_step":
        adv = torch.stack([torch.ones(4), adv], dim=1)
    kept, dropped = drop_nonfinite_advantages(batch(adv))
    assert dropped == 2 and kept.cond.tolist() == [0, 2]
    same, none = drop_nonfinite_advantages(batch(torch.ones(3)))
    assert none == 0 and len(same) == 3


def test_group_gradient_norms_split_the_total_by_top_level_module_and_average_over_steps():
    from steadyrl.trainer.health import group_grad_norms, mean_group_norms

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    model.register_parameter("scale", torch.nn.Parameter(torch.ones(1)))
    model[0].weight.grad = torch.full((2, 3), 2.0)  # its bias has no gradient: left out
    model[1].weight.grad = torch.tensor([[3.0, 4.0]])
    model.scale.grad = torch.tensor([-1.0])
    norms = group_grad_norms(model)
    assert norms == {"0": pytest.approx(math.sqrt(24.0)), "1": pytest.approx(5.0), "": pytest.approx(1.0)}
    total = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    assert math.sqrt(sum(v ** 2 for v in norms.values())) == pytest.approx(float(total))
    assert mean_group_norms([{"0": 1.0, "": 2.0}, {"0": 3.0}]) == {"health/grad_norm_0": 2.0,
                                                                   "health/grad_norm_root": 2.0}


def test_group_clipping_caps_each_modules_gradient_norm_and_leaves_smaller_ones_alone():
    from steadyrl.trainer.health import clip_group_gradients, group_grad_norms

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1, bias=False))
    model[0].weight.grad = torch.full((2, 3), 2.0)  # norm sqrt(24) ~ 4.9: clipped to 2
    model[0].bias.grad = torch.zeros(2)
    model[1].weight.grad = torch.tensor([[0.6, 0.8]])  # norm 1: below the cap, unchanged
    direction = model[0].weight.grad / model[0].weight.grad.norm()
    assert clip_group_gradients(model, 2.0) == 1
    assert group_grad_norms(model) == {"0": pytest.approx(2.0), "1": pytest.approx(1.0)}
    assert torch.allclose(model[0].weight.grad / model[0].weight.grad.norm(), direction)
    assert torch.equal(model[1].weight.grad, torch.tensor([[0.6, 0.8]]))
