"""The ratio invariant, for every image sampler: with the rollout's own weights the importance ratio of every
stored transition is exactly 1, i.e. in float64 the learner's recompute of a stored transition's log-prob equals
the rollout's to 1e-9, for any batch size and micro-batch split."""
from __future__ import annotations

import pytest
import torch

from steadyrl.rollout.config import DDIMSamplerConfig, FlowSDESamplerConfig, SchedulerConfig, UNetConfig
from steadyrl.rollout.models import build_class_policy
from steadyrl.rollout.sampler_factory import build_sampler

TINY = UNetConfig(block_out_channels=(8, 16), norm_num_groups=4)
SAMPLERS = {"ddim": DDIMSamplerConfig(num_steps=6), "flow_sde": FlowSDESamplerConfig(num_steps=6)}


@pytest.mark.parametrize("kind", sorted(SAMPLERS))
@pytest.mark.parametrize("batch_size", [1, 3, 16])
def test_float64_recompute_matches_rollout_for_any_microbatch_split(kind, batch_size):
    torch.manual_seed(0)
    model = build_class_policy(TINY).to(torch.float64)
    sampler = build_sampler(SAMPLERS[kind], SchedulerConfig())
    cond = torch.arange(batch_size) % 10
    batch = sampler.sample(model, cond, 1, torch.Generator().manual_seed(batch_size), dtype=torch.float64)
    for micro in sorted({1, 2, 5, batch_size}):
        for mb in batch.split(micro):
            for k in sampler.trainable_steps.tolist():
                lp = sampler.log_prob(model, mb, k).logp
                assert torch.allclose(lp, mb.old_logp[:, k], rtol=0, atol=1e-9), (batch_size, micro, k)
    # per-sample step indices (as the learner uses) give the same values
    steps = sampler.trainable_steps[torch.arange(batch_size) % len(sampler.trainable_steps)]
    lp = sampler.log_prob(model, batch, steps).logp
    assert torch.allclose(lp, batch.old_logp[torch.arange(batch_size), steps], rtol=0, atol=1e-9)


def test_every_sampler_is_a_sampler_and_only_the_gaussian_family_has_step_std_and_dt():
    """The `Sampler` protocol is what the learner types against; masked diffusion fills no Gaussian fields."""
    from steadyrl.rollout.likelihood import SequenceLogProb
    from steadyrl.rollout.sampler import GaussianStepSampler, Sampler, SequenceSampler, StepLogProb
    from tests.helpers import arith_prompts, masked_sampler, tiny_lm

    torch.manual_seed(0)
    model = build_class_policy(TINY).to(torch.float64)
    for kind, cfg in SAMPLERS.items():
        sampler = build_sampler(cfg, SchedulerConfig())
        assert isinstance(sampler, Sampler) and isinstance(sampler, GaussianStepSampler), kind
        batch = sampler.sample(model, torch.arange(3), 1, torch.Generator().manual_seed(0), dtype=torch.float64)
        step = sampler.trainable_steps[0]
        out = sampler.log_prob(model, batch, int(step))
        assert isinstance(out, StepLogProb) and out.std.shape == out.dt.shape == (3,), kind
        assert torch.equal(out.dt, sampler.dt[torch.full((3,), int(step))])
    lm, masked = tiny_lm(), masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    assert isinstance(masked, SequenceSampler) and not isinstance(masked, GaussianStepSampler)
    assert not hasattr(masked, "std") and not hasattr(masked, "dt")
    batch = masked.sample(lm, arith_prompts(2), 2, torch.Generator().manual_seed(0))
    out = masked.log_prob(lm, batch, 0)
    assert isinstance(out, SequenceLogProb) and not hasattr(out, "std") and not hasattr(out, "mean")
