"""vLLM's DiffusionGemma path (`sampler.kind: block_diffusion`, `backend: vllm`) against the installed vLLM, as far as
a machine without a GPU can take it: vLLM 0.32 samples diffusion models only on its V2 model runner, which needs
Triton on a GPU, so the engine itself never starts here. What is checked is everything around it, with vLLM's own
code: the checkpoint and generation settings it reads, the engine and request options it validates, and the refusal
a user meets on such a machine (before anything loads). Collected only where vLLM is installed."""
from __future__ import annotations

import importlib.util
import re
import types
from pathlib import Path

import pytest
import torch

from steadyrl.rollout.arith import TOKENIZER
from steadyrl.rollout.block_diffusion_lm import BlockDiffusionLMConfig, block_logits, build_block_diffusion_lm
from steadyrl.rollout.causal_lm import write_hf_checkpoint
from steadyrl.rollout.config import BlockDiffusionSamplerConfig
from steadyrl.rollout.vllm_diffusion import (VLLMBlockDiffusionEngine, engine_options, generation_config,
                                             request_options)
from steadyrl.services.config import CONFIG_DIR, load_config

EOS, PAD = TOKENIZER.eos_id, TOKENIZER.pad_id
CFG = BlockDiffusionSamplerConfig(gen_length=8, canvas_length=4, num_steps=6, entropy_bound=0.2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    net = build_block_diffusion_lm(BlockDiffusionLMConfig(), len(TOKENIZER), PAD, EOS, CFG.block).eval()
    return net, write_hf_checkpoint(net, tmp_path_factory.mktemp("tiny-diffusiongemma"), generation_config(CFG))


def vllm_source(module: str) -> str:
    return Path(importlib.util.find_spec(module).origin).read_text()


def test_the_checkpoint_holds_every_generation_setting_vllms_diffusiongemma_sampler_reads(checkpoint):
    """vLLM reads t_min, t_max, confidence_threshold and stability_threshold as `gen[...]` (a missing one is a
    KeyError at engine start) and an EntropyBound sampler_config with a positive bound: the written
    generation_config.json holds each, with the sampler's values."""
    import json

    _, path = checkpoint
    source = vllm_source("vllm.model_executor.models.diffusion_gemma")
    required = set(re.findall(r'gen(?:_config)?\["(\w+)"\]', source))
    assert {"t_min", "t_max", "confidence_threshold", "stability_threshold"} <= required
    written = json.loads((path / "generation_config.json").read_text())
    assert required <= set(written)
    sampler_config = written["sampler_config"]
    assert "EntropyBound" in sampler_config["_cls_name"] and sampler_config["entropy_bound"] == 0.2
    assert (written["t_min"], written["t_max"], written["max_denoising_steps"]) == (CFG.t_min, CFG.t_max, 6)


def test_vllm_reads_the_checkpoint_as_a_diffusion_model_and_transformers_loads_it_back(checkpoint):
    """vLLM's own `ModelConfig.is_diffusion` rule on the written config, and the checkpoint (tied encoder/decoder
    weights written apart) reloaded by this venv's transformers holds bitwise the same tensors and gives the same
    logits to float rounding (the reloaded model may take another attention kernel: 6e-7 apart on logits of ~1)."""
    from transformers import AutoConfig, DiffusionGemmaForBlockDiffusion
    from vllm.config.model import ModelConfig

    net, path = checkpoint
    hf_config = AutoConfig.from_pretrained(path)
    assert ModelConfig.is_diffusion.func(types.SimpleNamespace(hf_config=hf_config))
    assert hf_config.architectures == ["DiffusionGemmaForBlockDiffusion"] and hf_config.canvas_length == CFG.block
    again = DiffusionGemmaForBlockDiffusion.from_pretrained(path).eval()
    x, canvas = torch.randint(3, 16, (2, 6)), torch.randint(0, 19, (2, CFG.block))
    reloaded, written = again.state_dict(), net.state_dict()
    assert reloaded.keys() == written.keys() and all(torch.equal(reloaded[k], written[k]) for k in written)
    with torch.no_grad():
        torch.testing.assert_close(block_logits(again, x, None, canvas), block_logits(net, x, None, canvas),
                                   rtol=1e-5, atol=1e-5)


def test_the_engine_and_request_options_pass_vllms_own_validation(checkpoint):
    """The engine options as vLLM's EngineArgs turns them into its DiffusionConfig (what `--diffusion-config` gives),
    and each request's SamplingParams through vLLM's diffusion checks (temperature 1, no seed, extra_args within the
    served canvas); the options vLLM refuses are refused."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import EngineArgs
    from vllm.exceptions import VLLMValidationError
    from vllm.utils.diffusion import validate_diffusion_sampling_params

    args = EngineArgs(model=str(checkpoint[1]), **engine_options(CFG))
    served = args.create_diffusion_config()
    assert (served.canvas_length, served.max_denoising_steps, args.max_num_seqs) == (4, 6, 8)
    params = SamplingParams(**request_options(CFG, EOS))
    diffusion_model = types.SimpleNamespace(is_diffusion=True)
    params._validate_diffusion(diffusion_model)
    validate_diffusion_sampling_params(params, canvas_length=served.canvas_length, vocab_size=19)
    assert params.extra_args == {"diffusion_max_steps": 6, "diffusion_canvas_length": 4}
    with pytest.raises(VLLMValidationError, match="temperature"):
        SamplingParams(temperature=0.7)._validate_diffusion(diffusion_model)
    with pytest.raises(VLLMValidationError, match="diffusion_canvas_length"):
        wider = BlockDiffusionSamplerConfig(gen_length=8, canvas_length=8)
        validate_diffusion_sampling_params(SamplingParams(**request_options(wider, EOS)), canvas_length=4,
                                           vocab_size=19)


def test_without_a_triton_gpu_the_engine_is_refused_before_anything_loads(checkpoint, tmp_path):
    """This CPU build: the engine and the testbed's preflight (before Ray starts) both say that vLLM samples
    diffusion models only on GPUs, with vLLM's version and the platform, and name the backend that works."""
    import vllm

    from steadyrl.services.testbeds import build_testbed

    _, path = checkpoint
    message = rf"vLLM {re.escape(vllm.__version__)} samples diffusion LMs .* only on GPUs.*platform 'cpu'.*" \
              r"sampler.backend=transformers"
    with pytest.raises(RuntimeError, match=message):
        VLLMBlockDiffusionEngine(str(path), CFG, 64, {})
    testbed = build_testbed(load_config(CONFIG_DIR / "arith-bd-grpo.yaml", ["sampler.backend=vllm"]))
    with pytest.raises(RuntimeError, match=message):
        testbed.preflight()
