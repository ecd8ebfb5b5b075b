"""The DDIM sampler's stored log-probs and the learner's recompute are the same math: the Gaussian log-density of
the stored transition x_t -> x_{t-1} under the stated step mean and std, so a recompute with the rollout's weights
reproduces the stored value (to float rounding)."""
from __future__ import annotations

import math

import pytest
import torch

from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig, UNetConfig
from steadyrl.rollout.ddim import DDIMLogProbSampler, gaussian_logp
from steadyrl.rollout.models import build_scheduler, build_class_policy

TINY = UNetConfig(block_out_channels=(8, 16), norm_num_groups=4)


def make(dtype=torch.float64, **sampler_kw):
    torch.manual_seed(0)
    model = build_class_policy(TINY).to(dtype)
    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=6, **sampler_kw), build_scheduler(SchedulerConfig()))
    return model, sampler



def test_last_step_is_deterministic_and_never_trained():
    model, sampler = make()
    assert not bool(sampler.trainable[-1]) and bool(sampler.trainable[:-1].all())
    batch = sampler.sample(model, torch.arange(2), 2, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(batch.old_logp[:, -1], torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="deterministic"):
        sampler.log_prob(model, batch, sampler.cfg.num_steps - 1)


def test_step_is_the_stated_gaussian():
    """x_prev - mu over many draws has the stated std, and log N matches torch.distributions."""
    model, sampler = make()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 1, 8, 8, generator=g, dtype=torch.float64)
    dist = sampler.step_distribution(model, x, torch.full((4,), 1), torch.zeros(4, dtype=torch.long))
    mean, std = dist.mean, dist.std
    draw = mean + std.view(-1, 1, 1, 1) * torch.randn(mean.shape, generator=g, dtype=torch.float64)
    ref = torch.distributions.Normal(mean, std.view(-1, 1, 1, 1)).log_prob(draw)
    assert torch.allclose(gaussian_logp(draw, mean, std, "mean"), ref.mean(dim=(1, 2, 3)), atol=1e-12)
    assert torch.allclose(gaussian_logp(draw, mean, std, "sum"), ref.sum(dim=(1, 2, 3)), atol=1e-9)
    a_t, a_prev = sampler.alpha_t[1], sampler.alpha_prev[1]
    expected = math.sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev))  # eta = 1
    assert float(std[0]) == pytest.approx(expected, rel=1e-12)


def test_logp_reduce_sum_is_mean_times_dimensions():
    model, s_mean = make(logp_reduce="mean")
    _, s_sum = make(logp_reduce="sum")
    b1 = s_mean.sample(model, torch.arange(3), 1, torch.Generator().manual_seed(2), dtype=torch.float64)
    b2 = s_sum.sample(model, torch.arange(3), 1, torch.Generator().manual_seed(2), dtype=torch.float64)
    assert torch.allclose(b2.old_logp, b1.old_logp * 64, atol=1e-8)


def test_float32_recompute_is_close_and_sampling_is_seeded():
    model, sampler = make(torch.float32)
    b1 = sampler.sample(model, torch.arange(10), 4, torch.Generator().manual_seed(3))
    b2 = sampler.sample(model, torch.arange(10), 4, torch.Generator().manual_seed(3))
    assert torch.equal(b1.samples, b2.samples)
    for mb in b1.split(7):
        lp = sampler.log_prob(model, mb, 2).logp
        assert (lp - mb.old_logp[:, 2]).abs().max() < 1e-3
