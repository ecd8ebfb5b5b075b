"""A non-finite gradient skips its optimiser step (the H200 smoke's bf16 FLUX run wrote NaN into every LoRA weight
and then sampled from them), with a real DeepSpeed engine: the weights stay as they were and finite, the skip is
counted, and the next finite step trains."""
from __future__ import annotations

import math

import torch

from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig
from steadyrl.rollout.ddim import DDIMLogProbSampler
from steadyrl.rollout.models import build_scheduler
from steadyrl.trainer.objectives.grpo import GRPOSettings
from tests.test_grpo_guard import make_learner


def weights(learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.policy.named_parameters() if p.requires_grad}


def surrogate(learner, scale: float) -> torch.Tensor:
    return scale * sum((p.float() ** 2).sum() for p in learner.policy.parameters() if p.requires_grad)


def test_a_nonfinite_gradient_leaves_the_weights_and_a_finite_one_trains() -> None:
    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=4), build_scheduler(SchedulerConfig()))
    learner = make_learner(sampler, GRPOSettings(), lr=1e-2)
    before = weights(learner)
    learner._backward(surrogate(learner, math.nan), last=True)
    after = weights(learner)
    assert learner._steps_skipped == 1
    assert all(torch.equal(before[n], after[n]) for n in before)  # AdamW's weight decay did not move them either
    assert all(v.isfinite().all() for v in after.values())
    learner._backward(surrogate(learner, 1.0), last=True)
    trained = weights(learner)
    assert learner._steps_skipped == 1
    assert any(not torch.equal(after[n], trained[n]) for n in after)
    assert all(v.isfinite().all() for v in trained.values())
