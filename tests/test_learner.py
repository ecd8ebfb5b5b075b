"""The DeepSpeed learner on CPU (gloo): old-logp recompute, exact no-op, learning direction, checkpoints."""
from __future__ import annotations


import pytest
import torch

from steadyrl.rollout.models import build_class_policy
from steadyrl.trainer.config import LearnerConfig
from tests.helpers import TINY_UNET, tiny_learner


@pytest.fixture(scope="module")
def learner():
    return tiny_learner(LearnerConfig(lr=1e-3, micro_batch_size=8, inner_epochs=1))


def scored_batch(learner, reward_fn, seed=0):
    policy = build_class_policy(TINY_UNET)
    policy.load_trainable_state_dict(learner.weights())
    b = learner.sampler.sample(policy, torch.arange(4), 6, torch.Generator().manual_seed(seed))
    r = reward_fn(b.samples)
    return b.replace(rewards=r[:, None], reward_names=["r"], reward_key="r")


def test_constant_rewards_give_zero_advantage_and_leave_weights_unchanged(learner):
    before = learner.weights()
    m = learner.update(scored_batch(learner, lambda x: torch.ones(len(x))))
    after = learner.weights()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m["policy/adv_abs_mean"] == 0.0
    # the rollout ran with the same weights: the learner's recompute of the old log-probs equals the rollout's
    # stored ones up to float32 rounding (< 1e-4), so the stale-weights alarm does not fire
    assert m["policy/rollout_logp_absdiff_max"] < 1e-4 and m["policy/rollout_logp_alarm"] == 0.0


def test_update_moves_the_policy_towards_higher_reward(learner):
    """Reward = mean pixel brightness; after a few updates fresh samples are brighter."""
    bright = lambda x: x.mean(dim=(1, 2, 3))  # noqa: E731
    start = float(bright(scored_batch(learner, bright, seed=100).samples).mean())
    for i in range(6):
        m = learner.update(scored_batch(learner, bright, seed=i))
        assert m["policy/optimizer_steps"] == 3 and m["policy/grad_norm"] > 0
    end = float(bright(scored_batch(learner, bright, seed=100).samples).mean())
    assert end > start + 0.02, (start, end)


def test_stale_rollout_weights_raise_the_logp_alarm(learner):
    b = scored_batch(learner, lambda x: x.mean(dim=(1, 2, 3)))
    b = b.replace(old_logp=b.old_logp + 0.01 * learner.sampler.trainable.float())
    m = learner.update(b)
    assert m["policy/rollout_logp_absdiff_max"] == pytest.approx(0.01, abs=1e-4)
    assert m["policy/rollout_logp_alarm"] == 1.0


def test_non_finite_rewards_are_skipped_and_counted(learner):
    def reward(x):
        r = x.mean(dim=(1, 2, 3))
        r[0] = float("nan")
        return r

    m = learner.update(scored_batch(learner, reward))
    assert m["reward/nonfinite_skipped"] == 1.0


def test_save_and_load_restore_weights_optimiser_and_rng(learner, tmp_path):
    learner.save(tmp_path)
    saved = learner.weights()
    gen_state = learner.generator.get_state()
    opt_state = {k: v.clone() for k, v in learner.engine.optimizer.state_dict()["state"][0].items()
                 if torch.is_tensor(v)}
    learner.update(scored_batch(learner, lambda x: x.mean(dim=(1, 2, 3)), seed=7))
    assert any(not torch.equal(saved[k], v) for k, v in learner.weights().items())
    learner.load(tmp_path)
    assert all(torch.equal(saved[k], v) for k, v in learner.weights().items())
    assert torch.equal(learner.generator.get_state(), gen_state)
    restored = learner.engine.optimizer.state_dict()["state"][0]
    assert all(torch.equal(opt_state[k], restored[k]) for k in opt_state)


def test_the_health_panel_reports_reward_and_advantage_quantiles_and_silent_groups(learner):
    """health/*: each reward model's p10/p50/p90 and the advantages' quantiles and std equal numpy's on the batch;
    the zero-std fraction counts the groups whose rewards are all equal (here every other class)."""
    import numpy as np

    def reward(x):  # groups of classes 0 and 2 all score 1: no signal there
        r = x.mean(dim=(1, 2, 3)).clone()
        r[:6], r[12:18] = 1.0, 1.0
        return r

    batch = scored_batch(learner, reward)
    m = learner.update(batch)
    r = batch.rewards[:, 0].double().numpy()
    for q in (10, 50, 90):
        assert m[f"health/reward_r_p{q}"] == pytest.approx(float(np.quantile(r, q / 100)), rel=1e-9)
    adv, _ = learner.objective.prepare_batch(batch)
    a = adv.advantages.double().numpy()
    assert m["health/adv_p50"] == pytest.approx(float(np.quantile(a, 0.5)), abs=1e-9)
    assert m["health/adv_std"] == pytest.approx(float(a.std()), rel=1e-6)
    assert m["health/zero_std_group_frac"] == 0.5 and m["health/nonfinite_adv_dropped"] == 0.0
    # per top-level module of the UNet, the gradient norms; together they make up the total one
    groups = {k: v for k, v in m.items() if k.startswith("health/grad_norm_")}
    assert {"health/grad_norm_down_blocks", "health/grad_norm_up_blocks", "health/grad_norm_mid_block"} <= set(groups)
    assert sum(v ** 2 for v in groups.values()) ** 0.5 == pytest.approx(m["policy/grad_norm"], rel=0.3)


def test_samples_whose_advantage_overflows_are_dropped_and_counted_and_the_rest_train(learner):
    """Finite rewards of +-3e38 overflow a group's mean and std: its advantages are NaN. The learner drops that
    group's samples, counts them, and still takes its optimiser steps on the other groups."""
    def reward(x):
        r = x.mean(dim=(1, 2, 3)).clone()
        r[:6] = torch.tensor([3e38, 3e38, -3e38, 3e38, -3e38, 3e38])
        return r

    before = learner.weights()
    m = learner.update(scored_batch(learner, reward))
    assert m["health/nonfinite_adv_dropped"] == 6.0 and m["policy/samples"] == 18.0
    after = learner.weights()
    assert all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_a_cosine_schedule_sets_each_updates_learning_rate_and_survives_a_resume(tmp_path):
    """Warm-up over 2 updates, cosine to 0.1 x lr at update 6: the lr each update ran with (policy/lr) is the
    formula's, recomputed here independently; a learner loaded from a checkpoint after update 3 continues it."""
    import math

    from steadyrl.trainer.lr_schedule import LRScheduleConfig

    schedule = LRScheduleConfig(kind="cosine", warmup_updates=2, total_updates=6, min_lr_ratio=0.1)
    cfg = LearnerConfig(lr=1e-3, micro_batch_size=8, inner_epochs=1, lr_schedule=schedule)

    def expected(u: int) -> float:
        if u < 2:
            return 1e-3 * (u + 1) / 2
        return 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(u - 2, 4) / 4)))

    first = tiny_learner(cfg)
    bright = lambda x: x.mean(dim=(1, 2, 3))  # noqa: E731
    lrs = [first.update(scored_batch(first, bright, seed=u))["policy/lr"] for u in range(4)]
    first.save(tmp_path / "ckpt")
    second = tiny_learner(cfg)
    second.load(tmp_path / "ckpt")
    lrs += [second.update(scored_batch(second, bright, seed=u))["policy/lr"] for u in range(4, 8)]
    assert lrs == pytest.approx([expected(u) for u in range(8)], rel=1e-12)
    assert lrs[0] == pytest.approx(5e-4) and lrs[7] == pytest.approx(1e-4)


def test_group_gradient_clipping_clips_every_module_above_the_cap_and_none_below_it(learner):
    """learner.group_grad_clip: with a cap far below any module's gradient norm every module with a gradient is
    clipped at each optimiser step (health/groups_clipped); with a cap far above, none is."""
    bright = lambda x: x.mean(dim=(1, 2, 3))  # noqa: E731
    tight = tiny_learner(LearnerConfig(lr=1e-3, micro_batch_size=8, inner_epochs=1, group_grad_clip=1e-9))
    m = tight.update(scored_batch(tight, bright))
    modules = sum(1 for k in m if k.startswith("health/grad_norm_"))
    assert modules >= 5 and m["health/groups_clipped"] == modules * m["policy/optimizer_steps"]
    loose = tiny_learner(LearnerConfig(lr=1e-3, micro_batch_size=8, inner_epochs=1, group_grad_clip=1e9))
    assert loose.update(scored_batch(loose, bright))["health/groups_clipped"] == 0.0


def test_a_linear_kl_schedule_sets_the_objectives_kl_weight_each_update():
    """kl_coef 0.5, linear to 3x over 4 updates: the weight each update ran with (policy/kl_weight) is
    0.5 x (1 + 2 min(u / 4, 1))."""
    from steadyrl.trainer.kl_schedule import KLScheduleConfig
    from steadyrl.trainer.objectives.grpo import GRPOSettings

    cfg = LearnerConfig(lr=1e-3, micro_batch_size=8, inner_epochs=1,
                        kl_schedule=KLScheduleConfig(kind="linear", end_ratio=3.0, total_updates=4))
    learner = tiny_learner(cfg, GRPOSettings(eps_clip=0.2, kl_coef=0.5))
    bright = lambda x: x.mean(dim=(1, 2, 3))  # noqa: E731
    weights = [learner.update(scored_batch(learner, bright, seed=u))["policy/kl_weight"] for u in range(6)]
    assert weights == pytest.approx([0.5 * (1 + 2 * min(u / 4, 1)) for u in range(6)], rel=1e-12)
