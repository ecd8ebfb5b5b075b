"""vLLM's DiffusionGemma engine as a block-diffusion rollout backend (`sampler.kind: block_diffusion`,
`backend: vllm`; written against vLLM 0.32.0).

What vLLM needs, and what it returns:
  engine       `diffusion_config={"canvas_length": CL, "max_denoising_steps": N}` (the CLI's `--diffusion-config`);
               vLLM runs diffusion models only on its V2 model runner, which needs Triton on a GPU (its CPU build
               refuses them: `check_diffusion_engine` says so before anything loads). FlashInfer attention is
               refused; at most 8 sequences at once, as vLLM sets for diffusion models by default.
  checkpoint   generation_config.json with `sampler_config` (EntropyBoundSamplerConfig, `entropy_bound`), `t_min`,
               `t_max`, `confidence_threshold`, `stability_threshold`, `max_denoising_steps`, read per engine, not
               per request (`generation_config`; the tiny model's checkpoint is written with the sampler's values).
  request      `temperature=1.0` and no `seed` (vLLM refuses others for diffusion models: the schedule's
               temperatures come from the checkpoint, and the noise from the engine's seed), `extra_args`
               `diffusion_max_steps` and `diffusion_canvas_length`.
  output       each block's argmax canvas, cut after the first stop token, and per token the log-softmax of the
               converging step's tempered logits at that token: a confidence (kept as extras `commit_logp`), not a
               likelihood. The learner recomputes the estimator (rollout/block_diffusion.py) for the old and new
               policy alike; the batch's old_logp is NaN.
Weights arrive as for autoregressive models (`VLLMEngine`): under transformers' parameter names, which vLLM maps
onto its own (the encoder's and decoder's shared weights become one).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from steadyrl.rollout.autoregressive import Generated
from steadyrl.rollout.block_diffusion import after_first_eos
from steadyrl.rollout.config import BlockDiffusionSamplerConfig
from steadyrl.rollout.likelihood import completion_valid
from steadyrl.rollout.lora import LoRAConfig
from steadyrl.rollout.vllm_engine import VLLMEngine, require_vllm


def generation_config(cfg: BlockDiffusionSamplerConfig) -> dict[str, Any]:
    """The generation_config.json entries vLLM's DiffusionGemma sampler reads (the sampler's settings)."""
    return {"sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": cfg.entropy_bound},
            "t_min": cfg.t_min, "t_max": cfg.t_max, "confidence_threshold": cfg.confidence_threshold,
            "stability_threshold": cfg.stability_threshold, "max_denoising_steps": cfg.num_steps}


def engine_options(cfg: BlockDiffusionSamplerConfig) -> dict[str, Any]:
    """`vllm.LLM` arguments of a diffusion engine: the CLI's `--diffusion-config '{...}'`, and at most 8 sequences at
    once (what vLLM itself sets for diffusion models when left at its default: more ran out of memory on an H200)."""
    return {"diffusion_config": {"canvas_length": cfg.block, "max_denoising_steps": cfg.num_steps},
            "max_num_seqs": min(cfg.vllm.max_num_seqs, 8)}


def request_options(cfg: BlockDiffusionSamplerConfig, eos_id: int) -> dict[str, Any]:
    """`vllm.SamplingParams` arguments of one completion."""
    return dict(temperature=1.0, seed=None, max_tokens=cfg.gen_length, logprobs=0, stop_token_ids=[eos_id],
                detokenize=False,
                extra_args={"diffusion_max_steps": cfg.num_steps, "diffusion_canvas_length": cfg.block})


def check_diffusion_engine(model: str) -> None:
    """Refuse, before anything loads, a machine where vLLM cannot sample a diffusion model: vLLM missing, or no
    Triton GPU backend for its V2 model runner."""
    vllm = require_vllm()
    from vllm.platforms import current_platform
    from vllm.triton_utils import HAS_TRITON

    if not current_platform.is_cuda_alike() or not HAS_TRITON:
        raise RuntimeError(
            f"vLLM {vllm.__version__} samples diffusion LMs ({model}) only on GPUs: they need its V2 model runner, "
            f"which needs Triton with a GPU backend, and this machine has platform {current_platform.device_name!r} "
            f"(Triton usable: {HAS_TRITON}). Use sampler.backend=transformers (steadyrl's own block-diffusion sampler)")


class VLLMBlockDiffusionEngine(VLLMEngine):
    """vLLM's DiffusionGemma engine as the rollout worker's policy: a `rollout.block_diffusion.BlockGenerationBackend`
    that loads the learner's trained tensors as `VLLMEngine` does."""

    def __init__(self, model: str, cfg: BlockDiffusionSamplerConfig, max_model_len: int,
                 trainable: dict[str, Tensor], lora: LoRAConfig | None = None, lora_targets: list[str] | None = None,
                 device: str = "cpu"):
        check_diffusion_engine(model)
        super().__init__(model, cfg.vllm, max_model_len, trainable, None, lora, lora_targets, device,
                         engine_kwargs=engine_options(cfg))

    def generate_blocks(self, prompts: Tensor, attention: Tensor | None, cfg: BlockDiffusionSamplerConfig,
                        eos_id: int, pad_id: int, generator: torch.Generator) -> Generated:
        """Completions of left-padded prompts (padding stripped) and the engine's commit confidences. The noise is
        the engine's (vLLM takes no per-request seed for diffusion models), so a step's samples do not replay."""
        from vllm import SamplingParams

        out = self.run(prompts, attention, SamplingParams(**request_options(cfg, eos_id)), cfg.gen_length, pad_id)
        tokens = after_first_eos(out.tokens, eos_id, pad_id)
        return Generated(tokens, out.token_logp * completion_valid(tokens, eos_id))
