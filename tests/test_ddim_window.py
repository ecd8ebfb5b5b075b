"""An SDE window on DDIM (MixGRPO's and Flow-GRPO-Fast's window on an epsilon UNet): a training rollout draws only
the window's steps with DDPO's sigma; its other steps are deterministic DDIM, checked against diffusers'
`DDIMScheduler.step(eta=0)`; only the window's steps carry log-probs (the learner trains only them:
tests/test_windowed_sde.py); evaluation is unchanged."""
from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler

from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig, SDEWindowConfig
from steadyrl.rollout.ddim import DDIMLogProbSampler
from steadyrl.rollout.models import build_class_policy, build_scheduler
from steadyrl.rollout.sampler import gaussian_logp
from steadyrl.services.config import ConfigError, load_config
from tests.helpers import TINY_UNET

F64 = torch.float64
COND = torch.tensor([0, 3, 7])


def sampler_with(num_steps: int = 6, **window) -> DDIMLogProbSampler:
    cfg = DDIMSamplerConfig(num_steps=num_steps, sde_window=SDEWindowConfig(**window) if window else None)
    return DDIMLogProbSampler(cfg, build_scheduler(SchedulerConfig()))


def policy(seed: int = 0):
    torch.manual_seed(seed)
    return build_class_policy(TINY_UNET).to(F64).eval()


def draw(sampler, model, seed: int = 0, **kw):
    return sampler.sample(model, COND, 2, torch.Generator().manual_seed(seed), dtype=F64, **kw)


def test_a_window_over_every_stochastic_step_is_todays_ddim_bit_for_bit_and_evaluation_ignores_the_window():
    model, plain = policy(), sampler_with()
    full = sampler_with(size=int(plain.trainable.sum()))  # 5 of the 6 steps (the last one has sigma 0)
    ref = draw(plain, model, seed=3)
    got = draw(full, model, seed=3, train_step=11)
    for name in ("traj", "old_logp", "samples", "trainable", "timesteps"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    assert torch.equal(draw(sampler_with(size=1, start=2), model, seed=3).traj, ref.traj)  # no train_step: eval


@torch.no_grad()
def test_outside_the_window_steps_are_diffusers_deterministic_ddim_and_inside_ddpos_gaussian():
    model, sampler = policy(), sampler_with(size=2, start=1)
    b = draw(sampler, model, seed=5, train_step=0)
    assert b.trainable.tolist() == [False, True, True, False, False, False]
    reference = DDIMScheduler.from_config(build_scheduler(SchedulerConfig()).config)
    reference.set_timesteps(6)
    for k in range(6):
        x, t = b.traj[:, k], sampler.timesteps[k]
        eps = model(x, t.repeat(len(b)), b.cond)
        if k in (1, 2):  # stored log-prob = log N(x_next; DDPO mean, sigma^2), recomputed from the formula
            dist = sampler.step_distribution(model, x, torch.full((len(b),), k), b.cond)
            want = gaussian_logp(b.traj[:, k + 1], dist.mean, dist.std, "mean")
            assert torch.allclose(b.old_logp[:, k], want, atol=1e-12) and bool((b.old_logp[:, k] != 0).all())
        else:  # deterministic DDIM: diffusers' own step with eta = 0, no log-prob
            step = reference.step(eps, int(t), x, eta=0.0).prev_sample
            assert float((b.traj[:, k + 1] - step).abs().max()) <= 1e-6, k  # diffusers' float32 alphas
            assert bool((b.old_logp[:, k] == 0).all())


def test_a_sliding_window_moves_with_the_training_step_and_replays_with_the_same_seed():
    model, sampler = policy(), sampler_with(size=2, start=0, shift_every=2)
    masks = {k: draw(sampler, model, train_step=k).trainable.nonzero().flatten().tolist() for k in (0, 2, 4, 6)}
    assert masks == {0: [0, 1], 2: [1, 2], 4: [2, 3], 6: [3, 4]}
    assert torch.equal(draw(sampler, model, seed=9, train_step=4).traj, draw(sampler, model, seed=9, train_step=4).traj)


@pytest.mark.parametrize("overrides, field", [
    (["sampler.sde_window.size=3", "sampler.sde_window.start=9"], "start=9 \\+ size=3 runs past"),
    (["sampler.sde_window.size=3", "sampler.sde_window.after=dpm_solver++"], "after=dpm_solver\\+\\+"),
])
def test_bad_ddim_windows_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=field):
        load_config(None, overrides)
