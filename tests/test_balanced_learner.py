"""BGPO's seed ("balanced gradient") options wired into the DeepSpeed learner, on images and on a dLLM."""
from __future__ import annotations

import pytest
import torch

from steadyrl.services.runtime import free_port, set_rank_env
from steadyrl.trainer.balanced_gradient import BalancedGradientConfig, DualMomentum
from steadyrl.trainer.config import LearnerConfig

ALL_ON = BalancedGradientConfig(module_grad_scaling=True, dual_momentum=True, advantage_quantile_clip=True,
                                quantile_window=50, activation_checkpointing=True)


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    set_rank_env(free_port())


def image_learner(balanced):
    from tests.test_learner_seams import FAMILIES, make_learner
    from steadyrl.trainer.objectives.grpo import GRPOSettings

    return make_learner(FAMILIES["ddim"], GRPOSettings(eps_clip=0.2), balanced=balanced)


def image_batch(learner, seed):
    from tests.test_learner_seams import brightness_batch

    return brightness_batch(learner, seed)


def dllm_learner(balanced):
    from tests.test_masked_diffusion import sampler, tiny_lm
    from steadyrl.trainer.learner import DeepSpeedLearner
    from steadyrl.trainer.objectives.bgpo import BGPOPaperSettings

    return DeepSpeedLearner(tiny_lm(dtype=torch.float32), sampler(mc_samples=2), BGPOPaperSettings(),
                            LearnerConfig(micro_batch_size=8, inner_epochs=1, balanced=balanced))


def dllm_batch(learner, seed):
    from tests.test_masked_diffusion import prompts, tiny_lm

    policy = tiny_lm(dtype=torch.float32)
    policy.load_state_dict(learner.weights())
    b = learner.sampler.sample(policy, prompts(4, seed), 4, torch.Generator().manual_seed(seed))
    r = (b.samples[:, 0] == 4).float() + 0.1 * torch.rand(len(b), generator=torch.Generator().manual_seed(seed))
    return b.replace(rewards=r.unsqueeze(1), reward_names=["r"], reward_key="r")


FAMILY = {"images": (image_learner, image_batch), "dllm": (dllm_learner, dllm_batch)}


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_every_option_at_once_trains_and_reports(family, tmp_path):
    build, batch = FAMILY[family]
    learner = build(ALL_ON)
    assert isinstance(learner.engine.optimizer, DualMomentum)
    before = {k: v.clone() for k, v in learner.weights().items()}
    for i in range(3):
        m = learner.update(batch(learner, i))
        assert all(torch.isfinite(torch.tensor(v)) for v in m.values())
        assert m["balanced/adv_clip_q"] > 0 and m["balanced/module_scale_max"] > 0
    assert any(not torch.equal(before[k], v) for k, v in learner.weights().items())
    # the clipper's window is part of the learner's checkpoint
    learner.save(tmp_path)
    fresh = build(ALL_ON)
    fresh.load(tmp_path)
    assert torch.equal(fresh.advantage_clipper.history(), learner.advantage_clipper.history())


def test_off_by_default_is_the_plain_adamw_learner():
    learner = image_learner(BalancedGradientConfig())
    assert not isinstance(learner.engine.optimizer, DualMomentum) and learner.advantage_clipper is None
    m = learner.update(image_batch(learner, 0))
    assert not any(k.startswith("balanced/") for k in m)


def test_module_gradient_scaling_with_zero_partitioning_is_refused():
    with pytest.raises(ValueError, match="module_grad_scaling needs zero_stage=0"):
        LearnerConfig(zero_stage=1, balanced=BalancedGradientConfig(module_grad_scaling=True))
