"""The LLaDA-8B-class GPU presets: they load with the authors' settings, and each runs a step of its objective,
sampler, LoRA and bf16 path on a tiny random LLaDA-interface model through `benchmarks/gpu_check.py --tiny llada`
(the same check the device runs on the real model)."""
from __future__ import annotations

import pytest

from steadyrl.services.config import CONFIG_DIR, load_config

PRESETS = {"llada-gsm8k-grpo": "grpo.d1", "llada-gsm8k-stabledrl-code": "stabledrl.code",
           "llada-gsm8k-stabledrl-paper": "stabledrl.paper", "llada-gsm8k-bgpo": "bgpo.paper"}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_the_preset_loads_lora_over_a_bf16_llada_with_its_objective(preset):
    cfg = load_config(CONFIG_DIR / f"{preset}.yaml")
    tb = cfg.testbed
    assert tb.pretrained == "GSAI-ML/LLaDA-8B-Instruct" and tb.trust_remote_code and tb.dtype == "bfloat16"
    assert tb.lora.rank == 128 and tb.lora.alpha == 64 and tb.task == "file" and tb.file.verifier == "math"
    assert cfg.objective.name == PRESETS[preset] and cfg.learner.backend == "nccl"
    assert (cfg.sampler.gen_length, cfg.sampler.block_length) == (256, 32)
    assert cfg.sampler.mc_samples == {"grpo.d1": 1, "bgpo.paper": 16}.get(PRESETS[preset], 2)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_one_step_of_the_preset_runs_on_a_tiny_llada(preset, tmp_path):
    from benchmarks.gpu_check import check, tiny_llada_overrides

    result = check(str(CONFIG_DIR / f"{preset}.yaml"), tiny_llada_overrides(tmp_path), steps=1)
    assert result["finite"] and result["steps"] == 1 and result["objective"] == PRESETS[preset]
    assert result["dtype"] == "bfloat16" and 0 < result["sync_bytes"] < 200_000  # the adapters, not the model
