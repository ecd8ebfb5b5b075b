"""Autoregressive (causal) language models: the arith_ar testbed's tiny Llama, and real models by name.

The autoregressive sampler calls every model as `model(input_ids, attention_mask=..., position_ids=...,
past_key_values=..., use_cache=...)` with `.logits` [B, S, V] (transformers' causal-LM interface). The tiny model
is a `LlamaForCausalLM` (a family vLLM serves, head_dim 64 as its CPU attention kernels want), so the same weights
run in the `transformers` and `vllm` rollout backends.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from steadyrl.rollout.policy import check_lm_family, load_tied_weights, lora_targets_by_type
from steadyrl.rollout.settings_base import StrictModel


class CausalLMConfig(StrictModel):
    """A tiny transformers `LlamaForCausalLM` (about 0.4 M parameters by default); no dropout, untied head."""

    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(2, ge=1, description="hidden_size / num_heads is the head size (64: vLLM's CPU kernels "
                           "support it)")
    intermediate_size: int = Field(256, ge=8)
    max_positions: int = Field(64, ge=8, description="longest prompt + completion")


def causal_lm_config(cfg: CausalLMConfig, vocab_size: int, pad_id: int, eos_id: int):
    """The transformers `LlamaConfig` of the tiny model (float32, eager attention, untied head, no dropout)."""
    from transformers import LlamaConfig

    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"model.hidden_size={cfg.hidden_size} must be a multiple of num_heads={cfg.num_heads}")
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_positions, pad_token_id=pad_id, eos_token_id=eos_id, bos_token_id=None,
        tie_word_embeddings=False, attention_dropout=0.0, attn_implementation="eager")


def build_causal_lm(cfg: CausalLMConfig, vocab_size: int, pad_id: int, eos_id: int) -> nn.Module:
    """A randomly initialised LlamaForCausalLM of this size."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(causal_lm_config(cfg, vocab_size, pad_id, eos_id))


# LoRA targets per model type (module-name suffixes): the attention and MLP projections of Llama-family blocks
DEFAULT_LORA_TARGETS = {model_type: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
                        for model_type in ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma2", "gemma3")}


def causal_lora_targets(net) -> list[str]:
    """The default LoRA target modules of a causal LM (or of its transformers config), by its model type."""
    return lora_targets_by_type(net, DEFAULT_LORA_TARGETS)


def causal_lm_from_weights(cfg: CausalLMConfig, vocab_size: int, pad_id: int, eos_id: int,
                           weights: dict[str, Tensor]) -> nn.Module:
    """The tiny causal LM of architecture `cfg` holding `weights` (e.g. from Ray's object store)."""
    model = build_causal_lm(cfg, vocab_size, pad_id, eos_id)
    model.load_state_dict(weights)
    return model.eval()


def load_pretrained_causal_lm(name_or_path: str, trust_remote_code: bool = False,
                              dtype: torch.dtype | None = None) -> nn.Module:
    """A real causal LM by hub id or local directory, in eval mode (`HF_HUB_OFFLINE=1`: a path or a filled cache)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    check_lm_family(config, name_or_path)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING and not getattr(config, "auto_map", None):
        raise ValueError(f"testbed.pretrained={name_or_path!r} (model_type {config.model_type!r}) is not a causal LM "
                         "transformers implements (AutoModelForCausalLM)")
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    return AutoModelForCausalLM.from_pretrained(name_or_path, config=config, **kwargs).eval()


def pretrained_causal_architecture(name_or_path: str, weights: dict[str, Tensor],
                                   trust_remote_code: bool = False) -> nn.Module:
    """The architecture of `name_or_path` (its config only) holding `weights` (tied copies re-tied)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return load_tied_weights(model, weights, name_or_path)


def write_hf_checkpoint(net: nn.Module, directory: Path, generation: dict[str, Any] | None = None) -> Path:
    """`net` (a transformers LM, adapters excluded) as a checkpoint directory an inference engine loads:
    config.json, model.safetensors and, when given, generation_config.json (`generation`: a diffusion LM's sampler
    settings, `rollout.vllm_diffusion.generation_config`)."""
    from steadyrl.rollout.state_dict import cpu_state

    directory.mkdir(parents=True, exist_ok=True)
    base = {k.replace(".base_layer.", "."): v for k, v in cpu_state(net).items()  # peft keeps the base there
            if "lora_" not in k}
    from safetensors.torch import save_file

    save_file(base, str(directory / "model.safetensors"))
    net.config.to_json_file(str(directory / "config.json"))
    if generation is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return directory


def write_peft_adapter(adapters: dict[str, Tensor], rank: int, alpha: float, targets: list[str],
                       directory: Path, base_model: str | None = None, task_type: str | None = "CAUSAL_LM",
                       dropout: float = 0.0) -> Path:
    """LoRA adapters (keys as our policies name them: `<module>.lora_A.default.weight`) as a PEFT adapter directory
    (adapter_config.json + adapter_model.safetensors, keys `base_model.model.<module>.lora_A.weight`), the format
    vLLM's LoRA loader and `peft.PeftModel.from_pretrained(base, directory)` read. `base_model`: the hub id or
    directory adapter_config.json names as `base_model_name_or_path`; `task_type`: peft's (None: a plain
    `PeftModel`, for models that are not causal LMs)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    renamed = {"base_model.model." + k.replace(".default.", "."): v.detach().float().contiguous().cpu()
               for k, v in adapters.items()}
    save_file(renamed, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": targets, "bias": "none",
              "lora_dropout": dropout, "task_type": task_type, "use_rslora": False, "use_dora": False,
              **({} if base_model is None else {"base_model_name_or_path": base_model})}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory
