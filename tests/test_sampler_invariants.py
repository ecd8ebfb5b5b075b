"""The ratio invariant, for every image sampler: with the rollout's own weights the importance ratio of every
stored transition is exactly 1, i.e. in float64 the learner's recompute of a stored transition's log-prob equals
the rollout's to 1e-9, for any batch size and micro-batch split."""
from __future__ import annotations

import pytest
import torch

from steadyrl.rollout.config import DDIMSamplerConfig, FlowSDESamplerConfig, SchedulerConfig, UNetConfig
from steadyrl.rollout.models import build_class_policy
from steadyrl.rollout.samplers import build_sampler

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
