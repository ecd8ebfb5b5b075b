"""Flow-GRPO's SDE on the rectified-flow model: each stochastic step is the stated Gaussian (so the learner's
recompute of a stored transition's log-prob is exact), the sigma grid is diffusers' flow-match grid, and the
velocity pretraining fits v = eps - x0 (and is cached apart from epsilon models)."""
from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from steadyrl.rollout.cache import build_key
from steadyrl.rollout.config import FlowSDESamplerConfig, SchedulerConfig, UNetConfig
from steadyrl.rollout.flow_sde import FlowSDESampler
from steadyrl.rollout.models import build_class_policy
from steadyrl.rollout.policy import ClassConditionalPolicy
from steadyrl.rollout.sampler import GaussianStepSampler, gaussian_logp
from steadyrl.services.testbeds.digits.pretrain import PretrainConfig, pretrain_unet, pretrained_unet_dir

TINY = UNetConfig(block_out_channels=(8, 16), norm_num_groups=4)


def make(dtype=torch.float64, **sampler_kw):
    torch.manual_seed(0)
    model = build_class_policy(TINY).to(dtype)
    sampler = FlowSDESampler(FlowSDESamplerConfig(num_steps=6, **sampler_kw), SchedulerConfig())
    return model, sampler


class OracleVelocity(torch.nn.Module):
    """The exact velocity eps - x0 of a known (x0, eps) pair, called like a policy: (x, t, cond) -> v."""

    def __init__(self, x0, eps):
        super().__init__()
        self.x0, self.eps = x0, eps
        self.calls = []

    def forward(self, x, t, cond=None):
        self.calls.append(t)
        return self.eps - self.x0


def test_every_step_but_the_last_is_stochastic():
    _, sampler = make()
    assert isinstance(sampler, GaussianStepSampler)
    assert len(sampler.trainable_steps) == sampler.cfg.num_steps - 1  # all but s = 0.001 -> 0


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_sigma_grid_and_timesteps_are_diffusers_flow_match_scheduler(shift):
    cfg = FlowSDESamplerConfig(num_steps=10, shift=shift)
    sampler = FlowSDESampler(cfg, SchedulerConfig(num_train_timesteps=1000))
    ref = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
    ref.set_timesteps(10)
    assert sampler.sigmas.dtype == torch.float64 and sampler.std.dtype == torch.float64
    assert torch.equal(sampler.sigmas, ref.sigmas.double())
    assert torch.equal(sampler.timesteps, ref.timesteps)
    assert float(sampler.sigmas[0]) == 1.0 and float(sampler.sigmas[-1]) == 0.0
    assert bool((sampler.sigmas[1:] < sampler.sigmas[:-1]).all())
    assert torch.equal(sampler.dt, (ref.sigmas[:-1].double() - ref.sigmas[1:].double()))
    assert torch.allclose(sampler.timesteps.double(), sampler.sigmas[:-1] * 1000, rtol=1e-6)


def test_step_is_the_stated_gaussian():
    """log N matches torch.distributions, the mean is Flow-GRPO's SDE step and the std its formula."""
    model, sampler = make(noise_level=0.7)
    g = torch.Generator().manual_seed(1)
    k = 2
    x = torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64)
    cond = torch.tensor([0, 3, 5, 9])
    dist = sampler.step_distribution(model, x, torch.full((4,), k), cond)
    draw = dist.mean + dist.std.view(-1, 1, 1, 1) * torch.randn(dist.mean.shape, generator=g, dtype=torch.float64)
    ref = torch.distributions.Normal(dist.mean, dist.std.view(-1, 1, 1, 1)).log_prob(draw)
    assert torch.allclose(dist.log_prob(draw, "mean"), ref.mean(dim=(1, 2, 3)), atol=1e-12)
    assert torch.allclose(gaussian_logp(draw, dist.mean, dist.std, "sum"), ref.sum(dim=(1, 2, 3)), atol=1e-9)
    # std from the formula, with plain Python floats of the grid: a sqrt(s / (1 - s)) sqrt(s - s_next)
    s, s_next = float(sampler.sigmas[k]), float(sampler.sigmas[k + 1])
    sigma_s = 0.7 * math.sqrt(s / (1 - s))
    assert float(dist.std[0]) == pytest.approx(sigma_s * math.sqrt(s - s_next), rel=1e-12)
    # mean in flow_grpo's rearranged form: x (1 + sigma^2 Delta / (2s)) + v (1 + sigma^2 (1-s) / (2s)) Delta
    v = model(x, sampler.timesteps[k].expand(4), cond)
    delta = s_next - s
    expected = x * (1 + sigma_s**2 * delta / (2 * s)) + v * (1 + sigma_s**2 * (1 - s) / (2 * s)) * delta
    assert torch.allclose(dist.mean, expected, rtol=0, atol=1e-12)


def test_noise_level_at_s_equal_one_uses_the_next_grid_value_and_is_finite():
    model, sampler = make(noise_level=0.7)
    s1 = float(sampler.sigmas[1])
    assert float(sampler.sigmas[0]) == 1.0
    assert float(sampler.noise_level[0]) == pytest.approx(0.7 * math.sqrt(1 / (1 - s1)), rel=1e-12)
    assert float(sampler.std[0]) == pytest.approx(0.7 * math.sqrt(1 / (1 - s1)) * math.sqrt(1 - s1), rel=1e-12)
    assert bool(torch.isfinite(sampler.noise_level).all()) and bool(torch.isfinite(sampler.std).all())
    assert bool(sampler.trainable[0])
    # the other steps use s itself in the denominator
    s = sampler.sigmas[1:-1]
    assert torch.allclose(sampler.noise_level[1:], 0.7 * torch.sqrt(s / (1 - s)), rtol=1e-12, atol=0)
    batch = sampler.sample(model, torch.arange(4), 2, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert bool(torch.isfinite(batch.traj).all()) and bool(torch.isfinite(batch.old_logp).all())


def test_last_step_is_deterministic_and_never_trained():
    model, sampler = make()
    assert float(sampler.std[-1]) < sampler.cfg.min_std and not bool(sampler.trainable[-1])
    batch = sampler.sample(model, torch.arange(2), 2, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(batch.old_logp[:, -1], torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="deterministic"):
        sampler.log_prob(model, batch, sampler.cfg.num_steps - 1)


@pytest.mark.parametrize("k", [0, 2, 4])
def test_exact_velocity_gives_euler_step_plus_score_correction(k):
    """With the true velocity v = eps - x0 at x = (1-s) x0 + s eps, the mean is the ODE's Euler step
    x + v Delta plus sigma_s^2 / (2s) * eps * Delta (= -sigma_s^2/2 * score * Delta, score = -eps / s)."""
    _, sampler = make(noise_level=0.7)
    g = torch.Generator().manual_seed(k)
    x0 = torch.rand(5, 1, 8, 8, generator=g, dtype=torch.float64) * 2 - 1
    eps = torch.randn(5, 1, 8, 8, generator=g, dtype=torch.float64)
    s, s_next = float(sampler.sigmas[k]), float(sampler.sigmas[k + 1])
    x = (1 - s) * x0 + s * eps
    oracle = OracleVelocity(x0, eps)
    dist = sampler.step_distribution(oracle, x, torch.full((5,), k), torch.zeros(5, dtype=torch.long))
    delta = s_next - s
    noise_var = float(sampler.noise_level[k]) ** 2
    euler = x + (eps - x0) * delta
    assert torch.allclose(dist.mean, euler + noise_var / (2 * s) * eps * delta, rtol=0, atol=1e-12)
    assert not torch.allclose(dist.mean, euler, rtol=0, atol=1e-3)  # the correction is not negligible
    # the model saw timestep s * num_train_timesteps
    assert torch.allclose(oracle.calls[0].double(), torch.full((5,), s * 1000, dtype=torch.float64), rtol=1e-6)


def _fixed_velocity_loss(model, n=256, seed=123):
    """Mean ||v_theta(x_s, 1000 s, y) - (eps - x0)||^2 on a fixed draw of real digits, s and eps."""
    from steadyrl.rollout.digits import load_digits_tensors

    g = torch.Generator().manual_seed(seed)
    images, labels = load_digits_tensors()
    idx = torch.randint(len(images), (n,), generator=g)
    x0, y = images[idx], labels[idx]
    s = torch.rand(n, generator=g)
    eps = torch.randn(x0.shape, generator=g)
    xs = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(xs, s * 1000, y), eps - x0).item()


def test_velocity_pretraining_fits_the_velocity_not_the_noise():
    sched, cfg = SchedulerConfig(), PretrainConfig(iterations=60, batch_size=32)
    torch.manual_seed(0)
    untrained = build_class_policy(TINY).eval()
    v60, losses = pretrain_unet(TINY, sched, cfg, progress=False, prediction="velocity")
    e60, _ = pretrain_unet(TINY, sched, cfg, progress=False, prediction="epsilon")
    v60, e60 = ClassConditionalPolicy(v60), ClassConditionalPolicy(e60)
    l0, lv, le = _fixed_velocity_loss(untrained), _fixed_velocity_loss(v60), _fixed_velocity_loss(e60)
    assert lv < 0.75 * l0, (l0, lv)  # measured: 1.81 -> 1.01
    assert lv < 0.8 * le, (le, lv)  # an epsilon model is a poor velocity model (measured 1.45)
    assert len(losses) == 60 and all(math.isfinite(x) for x in losses)
    with pytest.raises(ValueError, match="prediction"):
        pretrain_unet(TINY, sched, cfg, progress=False, prediction="x0")


def test_velocity_model_never_shares_the_epsilon_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("STEADYRL_CACHE", str(tmp_path))
    unet, sched, pre = UNetConfig(), SchedulerConfig(), PretrainConfig()
    eps_dir = pretrained_unet_dir(unet, sched, pre)
    # the epsilon key has no prediction field (as before velocity models existed)
    old_key = build_key({"unet": unet.model_dump(), "sched": sched.model_dump(), "pretrain": pre.model_dump()})
    assert eps_dir == tmp_path / "models" / f"digits-unet-{old_key}"
    assert pretrained_unet_dir(unet, sched, pre, prediction="epsilon") == eps_dir
    flow_dir = pretrained_unet_dir(unet, sched, pre, prediction="velocity")
    assert flow_dir != eps_dir and flow_dir.name.startswith("digits-flow-unet-")
    assert flow_dir.name.removeprefix("digits-flow-unet-") != old_key
