"""LoRA on masked-diffusion LMs (d1 trains an 8B dLLM this way): adapters only train, sync and checkpoint; the
reference is the base (adapters off); float32 adapters under a bf16 base; activation checkpointing; the loop."""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.lora import LoRAConfig, add_lora
from steadyrl.rollout.masked_lm import MaskedLMConfig, build_masked_lm, lora_targets
from steadyrl.rollout.policy import LanguageModelPolicy
from steadyrl.services.config import CONFIG_DIR
from steadyrl.services.runtime.ray_session import free_port, set_rank_env
from steadyrl.trainer.balanced_gradient import BalancedGradientConfig
from steadyrl.trainer.builders import build_deepspeed_learner
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.objectives.grpo import GRPOSettings
from tests.helpers import arith_prompts, masked_sampler, tiny_lm, train_local

ONE = TOKENIZER.encode("1")[0]


@pytest.fixture(scope="module", autouse=True)
def single_rank():
    set_rank_env(free_port())


def lora_policy(dtype=torch.float32, rank: int = 4):
    policy = LanguageModelPolicy(tiny_lm(dtype=dtype))
    return add_lora(policy, LoRAConfig(rank=rank, alpha=8.0), lora_targets(policy.net))


def rewarded(batch):
    return batch.replace(rewards=(batch.samples[:, 0] == ONE).float().unsqueeze(1), reward_names=["r"], reward_key="r")


def test_fresh_adapters_are_the_base_model_and_only_they_train():
    base, policy = tiny_lm(dtype=torch.float32), lora_policy()
    state = policy.trainable_state_dict()
    assert state and all("lora_" in k for k in state)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == {f"net.{k}" for k in state}
    x = torch.cat([arith_prompts(4), torch.full((4, 4), TOKENIZER.mask_token_id)], 1)
    assert torch.equal(policy(x).logits, base(x).logits)  # B = 0: exactly the base
    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    batch = s.sample(base, arith_prompts(4), 2, torch.Generator().manual_seed(0))
    assert torch.equal(s.log_prob(policy, batch, 1).logp, batch.old_logp[:, 1])


def test_a_lora_learner_learns_moving_only_adapters_and_keeps_the_base_as_reference():
    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    learner = build_deepspeed_learner(lora_policy(), s, GRPOSettings(eps_clip=0.2, kl_coef=0.01),
                                      LearnerConfig(lr=1e-2, micro_batch_size=16, inner_epochs=1))
    synced = learner.weights()  # what a weight sync and a checkpoint carry
    assert all("lora_" in k for k in synced)
    base = tiny_lm(dtype=torch.float32)
    full = sum(p.numel() for p in base.parameters())
    assert sum(v.numel() for v in synced.values()) < 0.2 * full

    def batch(seed):
        policy = lora_policy()
        policy.load_trainable_state_dict(learner.weights())
        return rewarded(s.sample(policy, arith_prompts(8, seed), 8, torch.Generator().manual_seed(seed)))

    start = float(batch(100).rewards.mean())
    for i in range(16):
        metrics = learner.update(batch(i))
    assert metrics["policy/kl_ref_monitor"] > 0  # the policy left its reference ...
    assert float(batch(100).rewards.mean()) > start + 0.2
    probe = batch(200)
    with torch.no_grad():  # ... and the reference is still the base model: adapters off
        assert torch.equal(s.log_prob(learner.reference, probe, 0).logp, s.log_prob(base, probe, 0).logp)
    trained = dict(learner.policy.net.named_parameters())
    for name, p in base.named_parameters():  # peft keeps a frozen weight under `<module>.base_layer.`
        live = trained.get(name, trained.get(name.replace(".weight", ".base_layer.weight").replace(
            ".bias", ".base_layer.bias")))
        assert live is not None and torch.equal(live, p), name


def test_a_bf16_base_keeps_float32_adapters_and_float32_log_probs():
    policy = lora_policy(dtype=torch.bfloat16)
    dtypes = {("lora_" in n, p.dtype) for n, p in policy.named_parameters()}
    assert dtypes == {(True, torch.float32), (False, torch.bfloat16)}
    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    batch = rewarded(s.sample(policy, arith_prompts(4), 4, torch.Generator().manual_seed(0)))
    assert batch.old_logp.dtype == torch.float32 and torch.isfinite(batch.old_logp).all()
    learner = build_deepspeed_learner(policy, s, GRPOSettings(eps_clip=0.2),
                                      LearnerConfig(lr=1e-2, micro_batch_size=16))
    before = {k: v.clone() for k, v in learner.weights().items()}
    metrics = learner.update(batch.replace(old_logp=batch.old_logp))
    assert metrics["policy/grad_norm"] > 0 and all(v.dtype == torch.float32 for v in learner.weights().values())
    assert any(not torch.equal(before[k], v) for k, v in learner.weights().items())


def test_activation_checkpointing_gives_the_same_lora_gradient():
    s = masked_sampler(mc_samples=2, gen_length=4, num_steps=4)
    batch = rewarded(s.sample(tiny_lm(dtype=torch.float32), arith_prompts(4), 4, torch.Generator().manual_seed(0)))
    norms = []
    for checkpointing in (False, True):
        cfg = LearnerConfig(lr=1e-3, micro_batch_size=16, grad_clip=1e9,
                            balanced=BalancedGradientConfig(activation_checkpointing=checkpointing))
        learner = build_deepspeed_learner(lora_policy(), s, GRPOSettings(eps_clip=0.2), cfg)
        learner.update(batch)
        norms.append(learner._pre_clip_norm)
    assert norms[0] > 0 and norms[1] == pytest.approx(norms[0], rel=1e-6)


def test_the_arith_loop_with_lora_moves_every_adapter_off_the_base_and_checkpoints_only_the_adapters(tmp_path):
    """`steadyrl train` with testbed.lora, two steps: the checkpoint holds exactly the adapters a fresh LoRA policy
    trains (no base weight); the reference beside it is bitwise those fresh adapters (B = 0: the base model); and
    every adapter has left its fresh value: the gradient reached each B, and each A once its B was non-zero (A's
    gradient is zero while B = 0)."""
    result, _ = train_local(CONFIG_DIR / "arith-grpo.yaml", tmp_path / "run",
                            ["testbed.lora.rank=4", "run.steps=2", "run.checkpoint_every=2", "testbed.eval_problems=20"])
    assert result.steps_done == 2
    step = tmp_path / "run" / "checkpoints" / "step_2"
    saved, reference = (load_file(str(step / f"{name}.safetensors")) for name in ("policy", "reference"))
    policy = LanguageModelPolicy(build_masked_lm(MaskedLMConfig(), len(TOKENIZER)))  # the testbed's model
    fresh = add_lora(policy, LoRAConfig(rank=4), lora_targets(policy.net)).trainable_state_dict()
    assert fresh and all("lora_" in k for k in fresh) and set(saved) == set(reference) == set(fresh)
    assert all(torch.equal(reference[k], v) for k, v in fresh.items())  # A from testbed.lora.init_seed, B = 0
    assert [k for k in saved if torch.equal(saved[k], fresh[k])] == []


def test_bf16_without_lora_is_refused_naming_the_settings():
    from steadyrl.services.testbeds.arith.masked import ArithSettings

    with pytest.raises(ValueError, match="testbed.dtype=bfloat16 needs testbed.lora"):
        ArithSettings(dtype="bfloat16")
