"""LoRA (peft) through the real DeepSpeed learner: only adapters train, sync and checkpoint; the reference is
the network with its reference adapters swapped in (at the start: adapters off, i.e. the base model)."""
from __future__ import annotations

import copy

import pytest
import torch

from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig, UNetConfig
from steadyrl.rollout.ddim import DDIMLogProbSampler
from steadyrl.rollout.lora import LoRAConfig, add_lora
from steadyrl.rollout.models import build_class_policy, build_scheduler
from steadyrl.rollout.policy import state_bytes
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.objectives.grpo import GRPOSettings

TINY = UNetConfig(block_out_channels=(8, 16), norm_num_groups=4)
TARGETS = ["conv1", "conv2"]  # the tiny UNet has no attention: adapters on its ResNet convolutions


def lora_policy(seed: int = 0):
    torch.manual_seed(seed)
    return add_lora(build_class_policy(TINY), LoRAConfig(rank=4, alpha=8), TARGETS)


def perturb_adapters(policy, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for v in policy.trainable_state_dict().values():
            v.add_(0.1 * torch.randn(v.shape, generator=g))


def inputs(n: int = 4):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, 1, 8, 8, generator=g), torch.full((n,), 500), torch.arange(n) % 10


@pytest.fixture(scope="module")
def learner():
    set_rank_env(free_port())
    from steadyrl.trainer.builders import build_deepspeed_learner

    sampler = DDIMLogProbSampler(DDIMSamplerConfig(num_steps=5), build_scheduler(SchedulerConfig()))
    return build_deepspeed_learner(lora_policy(), sampler, GRPOSettings(eps_clip=0.2, kl_coef=0.01),
                                   LearnerConfig(lr=3e-3, micro_batch_size=8, inner_epochs=1), seed=0)


def test_only_adapters_are_trainable_and_the_fresh_adapters_leave_the_network_unchanged():
    torch.manual_seed(0)
    plain = build_class_policy(TINY)
    adapted = add_lora(copy.deepcopy(plain), LoRAConfig(rank=4, alpha=8), TARGETS)
    assert adapted.trained_keys and all("lora_" in k for k in adapted.trained_keys)
    assert {n for n, p in adapted.net.named_parameters() if p.requires_grad} == set(adapted.trained_keys)
    x, t, c = inputs()
    with torch.no_grad():
        assert torch.equal(adapted(x, t, c), plain(x, t, c))  # B = 0: exactly the base model
    with pytest.raises(ValueError, match="lora.target_modules"):
        add_lora(build_class_policy(TINY), LoRAConfig(), ["no_such_module"])


def test_reference_is_adapters_off_and_swapping_it_in_leaves_the_live_weights_bitwise():
    torch.manual_seed(0)
    base = build_class_policy(TINY)
    policy = add_lora(copy.deepcopy(base), LoRAConfig(rank=4, alpha=8), TARGETS)
    reference = policy.reference()
    perturb_adapters(policy)  # the policy has moved away from its start
    live = {k: v.clone() for k, v in policy.trainable_state_dict().items()}
    x, t, c = inputs()
    with torch.no_grad():
        moved = policy(x, t, c)
        assert not torch.allclose(moved, base(x, t, c))
        assert torch.equal(reference(x, t, c), base(x, t, c))  # the reference: the base model, adapters off
        assert torch.equal(policy(x, t, c), moved)
    assert all(torch.equal(live[k], v) for k, v in policy.trainable_state_dict().items())
    reference.load_trainable_state_dict(policy.trainable_state_dict())  # a reference reset
    with torch.no_grad():
        assert torch.equal(reference(x, t, c), moved)


def scored_batch(learner, seed: int):
    policy = lora_policy()
    policy.load_trainable_state_dict(learner.weights())
    b = learner.sampler.sample(policy, torch.arange(4), 6, torch.Generator().manual_seed(seed))
    r = b.samples.mean(dim=(1, 2, 3))  # brightness
    return b.replace(rewards=r[:, None], reward_names=["r"], reward_key="r")


def test_an_update_moves_only_the_adapters_and_syncs_only_their_bytes(learner):
    frozen = {k: v.clone() for k, v in learner.policy.net.state_dict().items() if "lora_" not in k}
    before = learner.weights()
    m = learner.update(scored_batch(learner, 0))
    after = learner.weights()
    assert set(after) == set(learner.policy.trained_keys)
    assert any(not torch.equal(before[k], after[k]) for k in before)
    assert all(torch.equal(frozen[k], v) for k, v in learner.policy.net.state_dict().items() if "lora_" not in k)
    full = state_bytes(learner.policy.net.state_dict())
    assert m["sync/bytes"] == state_bytes(after) < 0.25 * full, (m["sync/bytes"], full)
    assert m["policy/rollout_logp_absdiff_max"] < 1e-4  # the rollout copy with synced adapters = the learner's


def test_lora_updates_ascend_the_policy_gradient_and_the_checkpoint_holds_adapters_not_the_base(learner, tmp_path):
    """sum_i A_i log pi(x_i) over the batch's trained steps rises after an update on it (the surrogate's
    gradient reaches the adapters with the right sign); a reset reference equals the policy; a checkpoint
    restores adapters and reference and does not write the frozen base."""
    batch = scored_batch(learner, 10)
    advantages = learner.objective.prepare_batch(batch)[0].advantages

    def surrogate() -> float:
        with torch.no_grad():
            return sum(float((advantages * learner.sampler.log_prob(learner.engine, batch, s).logp).sum())
                       for s in learner.sampler.trainable_steps.tolist())

    before = surrogate()
    learner.update(batch)
    assert surrogate() > before
    learner.reset_reference()
    x, t, c = inputs()
    with torch.no_grad():
        assert torch.equal(learner.reference(x, t, c), learner.policy(x, t, c))
    learner.save(tmp_path / "ckpt")
    saved, ref = learner.weights(), {k: v.clone() for k, v in learner.reference.trainable_state_dict().items()}
    learner.update(scored_batch(learner, 50))
    learner.ema_reference(0.5)
    assert any(not torch.equal(saved[k], v) for k, v in learner.weights().items())
    learner.load(tmp_path / "ckpt")
    assert all(torch.equal(saved[k], v) for k, v in learner.weights().items())
    assert all(torch.equal(ref[k], v) for k, v in learner.reference.trainable_state_dict().items())
    engine_bytes = sum(f.stat().st_size for f in (tmp_path / "ckpt" / "engine").rglob("*model_states.pt"))
    assert engine_bytes < state_bytes(learner.policy.net.state_dict())  # the frozen base is not written


def test_adapters_train_in_float32_under_a_bfloat16_base():
    torch.manual_seed(0)
    policy = add_lora(build_class_policy(TINY).to(torch.bfloat16), LoRAConfig(rank=4, alpha=8), TARGETS)
    dtypes = {n: p.dtype for n, p in policy.net.named_parameters()}
    assert all(d == (torch.float32 if "lora_" in n else torch.bfloat16) for n, d in dtypes.items())
    x, t, c = inputs()
    out = policy(x.to(torch.bfloat16), t, c)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32
               for n, p in policy.net.named_parameters() if "lora_" in n)
