"""Windowed SDE sampling on the rectified-flow sampler (MixGRPO, Flow-GRPO-Fast): SDE steps only inside a window
that is fixed, slides with the training step or is drawn per step; ODE (Euler) steps elsewhere; only the
window's steps are trained (on DDIM too; its sampling: tests/test_ddim_window.py)."""
from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import DDIMSamplerConfig, FlowSDESamplerConfig, SchedulerConfig, SDEWindowConfig
from steadyrl.rollout.flow_sde import FlowSDESampler
from steadyrl.rollout.models import build_class_policy
from steadyrl.rollout.sampler import gaussian_logp
from steadyrl.rollout.sde_window import window_mask, window_start
from tests.helpers import TINY_UNET

F64 = torch.float64
COND = torch.tensor([0, 3, 7])


def sampler_with(num_steps=6, **window) -> FlowSDESampler:
    cfg = FlowSDESamplerConfig(num_steps=num_steps, sde_window=SDEWindowConfig(**window) if window else None)
    return FlowSDESampler(cfg, SchedulerConfig())


def policy(seed=0):
    torch.manual_seed(seed)
    return build_class_policy(TINY_UNET).to(F64).eval()


def draw(sampler, model, seed=0, **kw):
    return sampler.sample(model, COND, 2, torch.Generator().manual_seed(seed), dtype=F64, **kw)


def test_a_window_over_every_stochastic_step_is_todays_sampler_bit_for_bit():
    model, plain = policy(), sampler_with()
    full = sampler_with(size=len(plain.trainable_steps))  # 5 of the 6 steps (the last one has std < min_std)
    ref, got = draw(plain, model, seed=3), draw(full, model, seed=3, train_step=17)
    for name in ("traj", "old_logp", "samples", "trainable", "timesteps"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    # evaluation (no training step) samples every stochastic step from the SDE, whatever the window
    narrow = sampler_with(size=1, start=2)
    assert torch.equal(draw(narrow, model, seed=3).traj, ref.traj)


@torch.no_grad()
def test_outside_the_window_steps_are_euler_ode_steps_and_inside_the_stated_sde_gaussian():
    model, sampler = policy(), sampler_with(size=2, start=1)
    b = draw(sampler, model, seed=5, train_step=0)
    assert b.trainable.tolist() == [False, True, True, False, False, False]
    sig = sampler.sigmas
    for k in range(6):
        x, t = b.traj[:, k], sampler.timesteps[k].repeat(len(b))
        v = model(x, t, b.cond)
        if k in (1, 2):  # the SDE step: stored log-prob is log N(x_next; Flow-GRPO mean, std^2) recomputed here
            s, d, a = float(sig[k]), float(sig[k + 1] - sig[k]), 0.7 * (float(sig[k]) / (1 - float(sig[k]))) ** 0.5
            mean = x + (v + a**2 / (2 * s) * (x + (1 - s) * v)) * d
            std = torch.full((len(b),), a * abs(d) ** 0.5, dtype=F64)
            assert torch.allclose(b.old_logp[:, k], gaussian_logp(b.traj[:, k + 1], mean, std, "mean"), atol=1e-12)
            assert not torch.allclose(b.traj[:, k + 1], mean)  # noise was added
        elif k < 5:  # outside: x + v Delta exactly, no log-prob
            assert torch.allclose(b.traj[:, k + 1], x + v * float(sig[k + 1] - sig[k]), atol=1e-12, rtol=0)
            assert bool((b.old_logp[:, k] == 0).all())


@torch.no_grad()
def test_ode_steps_are_deterministic_given_the_state():
    """Two noise seeds from the same x_T: identical until the window, different after it."""
    model, sampler = policy(), sampler_with(size=1, start=2)
    a = sampler.sample(model, COND, 2, torch.Generator().manual_seed(1), dtype=F64, train_step=0)
    x_t = a.traj[:, 0]
    g2 = torch.Generator().manual_seed(99)  # another noise stream from the same x_T
    b_steps = sampler.sde_steps(0)
    x = x_t
    for k in range(6):
        at = torch.full((6,), k)
        if b_steps[k]:
            dist = sampler.step_distribution(model, x, at, a.cond)
            x = dist.mean + dist.std.view(-1, 1, 1, 1) * torch.randn(x.shape, generator=g2, dtype=F64)
        elif sampler.trainable[k]:
            x = sampler.ode_mean(model, x, at, a.cond)
        else:
            x = sampler.step_distribution(model, x, at, a.cond).mean
        if k < 2:
            assert torch.equal(x, a.traj[:, k + 1]), k  # before the window: the same deterministic path
        else:
            assert not torch.allclose(x, a.traj[:, k + 1]), k  # the window's noise differs from here on


def test_mixgrpo_sliding_window_positions_follow_the_formula():
    # 9 stochastic steps of 10, window 4: last start 5. stop: min(start + stride * (k // every), last)
    stop = SDEWindowConfig(size=4, shift_every=25)
    expected = {0: 0, 24: 0, 25: 1, 49: 1, 50: 2, 124: 4, 125: 5, 150: 5, 10_000: 5}
    assert {k: window_start(stop, 9, k) for k in expected} == expected
    # restart (MixGRPO's roll_back): starts 0..5, then 0 again: start + stride * ((k // every) mod 6)
    restart = SDEWindowConfig(size=4, shift_every=25, at_end="restart")
    expected = {0: 0, 125: 5, 150: 0, 175: 1, 150 * 7 + 30: 1}
    assert {k: window_start(restart, 9, k) for k in expected} == expected
    # stride 2 from start 1 (Flash-style overlap settings): 1, 3, 5, then back to 1
    strided = SDEWindowConfig(size=4, start=1, shift_every=20, stride=2, at_end="restart")
    assert [window_start(strided, 9, 20 * n) for n in range(5)] == [1, 3, 5, 1, 3]
    # on the sampler: step 60 of MixGRPO's preset shape is window [2, 6)
    sampler = sampler_with(num_steps=10, size=4, shift_every=25)
    assert torch.nonzero(sampler.sde_steps(60)).flatten().tolist() == [2, 3, 4, 5]


def test_random_windows_vary_over_steps_and_replay_with_the_same_seed():
    cfg = SDEWindowConfig(size=2, start=1, random=True)
    starts = [window_start(cfg, 9, k, seed=7) for k in range(40)]
    assert starts == [window_start(cfg, 9, k, seed=7) for k in range(40)]  # a pure function of (cfg, step, seed)
    assert set(starts) <= set(range(1, 8)) and len(set(starts)) >= 4
    assert starts != [window_start(cfg, 9, k, seed=8) for k in range(40)]
    sampler, model = sampler_with(num_steps=10, size=2, start=1, random=True), policy()
    b1, b2 = draw(sampler, model, seed=0, train_step=3, window_seed=7), draw(sampler, model, seed=0, train_step=3,
                                                                           window_seed=7)
    assert torch.equal(b1.traj, b2.traj) and torch.equal(b1.old_logp, b2.old_logp)
    assert torch.equal(b1.trainable, window_mask(cfg, sampler.trainable, 3, 7))
    assert int(b1.trainable.sum()) == 2


@pytest.mark.parametrize("window, num_steps, field", [
    ({"size": 0}, 6, "sde_window.size"),
    ({"size": 2, "random": True, "shift_every": 10}, 6, "random=true and shift_every"),
    ({"size": 4, "start": 4}, 6, "runs past the grid"),
    ({"size": 2, "shift_every": 0}, 6, "sde_window.shift_every"),
    ({"size": 2, "at_end": "wrap"}, 6, "sde_window.at_end"),
])
def test_bad_windows_are_rejected_naming_the_field(window, num_steps, field):
    with pytest.raises(ValidationError, match=field):
        FlowSDESamplerConfig(num_steps=num_steps, sde_window=window)


def test_a_window_past_the_stochastic_steps_is_rejected_when_the_sampler_is_built():
    with pytest.raises(ValueError, match="sde_window: start=2 \\+ size=4 runs past the sampler's 5 stochastic"):
        sampler_with(num_steps=6, size=4, start=2)  # fits the 6-step grid, not its 5 stochastic steps


def test_batches_of_different_windows_do_not_concatenate():
    sampler, model = sampler_with(size=1, shift_every=1), policy()
    a, b = draw(sampler, model, train_step=0), draw(sampler, model, train_step=1)
    assert len(RolloutBatch.concat([a, draw(sampler, model, seed=1, train_step=0)])) == 12
    with pytest.raises(ValueError, match="trainable steps"):
        RolloutBatch.concat([a, b])


def test_reward_backprop_refuses_windowed_rollouts():
    sampler, model = sampler_with(size=2), policy()
    with pytest.raises(ValueError, match="sde_window"):
        sampler.recorded_noise(model, draw(sampler, model, train_step=0), 3)


@pytest.mark.parametrize("sampler_config", [FlowSDESamplerConfig, DDIMSamplerConfig])
def test_the_learner_trains_only_the_window_steps(sampler_config):
    from steadyrl.services.runtime.ray_session import free_port, set_rank_env
    from steadyrl.trainer.objectives.grpo import GRPOSettings
    from tests.helpers import make_image_learner, spy_on_log_prob

    set_rank_env(free_port())
    cfg = sampler_config(num_steps=6, sde_window=SDEWindowConfig(size=2, start=1, shift_every=1))
    learner = make_image_learner(cfg, GRPOSettings(eps_clip=0.2, timestep_fraction=1.0))
    sampler = learner.sampler
    asked = spy_on_log_prob(sampler)  # the steps the recompute and the terms ask for
    model = build_class_policy(TINY_UNET)
    model.load_trainable_state_dict(learner.weights())
    for train_step, window in ((0, {1, 2}), (2, {3, 4})):
        b = sampler.sample(model, torch.arange(4), 4, torch.Generator().manual_seed(train_step), train_step=train_step)
        assert set(torch.nonzero(b.trainable).flatten().tolist()) == window
        r = b.samples.mean(dim=(1, 2, 3))
        b = b.replace(rewards=r[:, None], reward_names=["bright"], reward_key="bright")
        asked.clear()
        metrics = learner.update(b)
        assert set(asked) == window  # timestep_fraction 1: every window step, and no other, is recomputed/trained
        assert metrics["policy/grad_norm"] > 0


def test_the_rollout_worker_samples_each_training_step_with_that_steps_window():
    """services/runtime/rollouts.py passes the step (and run seed) to the sampler: the Flow-GRPO-Fast preset's window
    at step k is window_mask(config, k, run.seed), and a re-issued step redraws the same batch."""
    from safetensors.torch import load_file

    from steadyrl.services.config import CONFIG_DIR, load_config
    from steadyrl.services.runtime.local_runtime import LocalScorer
    from steadyrl.services.runtime.rollouts import Rollouts

    cfg = load_config(CONFIG_DIR / "digits-flow-grpo-fast.yaml", ["sampler.group_size=2", "run.seed=5"])
    rollouts = Rollouts(cfg, load_file(str(_base_model(cfg))))
    score = LocalScorer(rollouts.testbed.reward_ensemble())
    stochastic = rollouts.sampler.trainable
    windows = set()
    for step in (0, 1, 2, 3):
        batch, _ = rollouts.generate(step, 0, 1, score)
        assert torch.equal(batch.trainable, window_mask(cfg.sampler.sde_window, stochastic, step, 5)), step
        windows.add(tuple(batch.trainable.tolist()))
    assert len(windows) > 1
    again, _ = rollouts.generate(3, 0, 1, score)
    assert torch.equal(again.traj, batch.traj) and torch.equal(again.old_logp, batch.old_logp)


def _base_model(cfg):
    from steadyrl.services.testbeds import build_testbed

    return build_testbed(cfg).base_weights(progress=False)
