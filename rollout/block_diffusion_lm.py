"""Block-diffusion language models (DiffusionGemma): the arith_bd testbed's tiny model, and real ones by name.

A DiffusionGemma (`transformers.DiffusionGemmaForBlockDiffusion`) reads a clean prefix causally into a key/value
cache (its encoder) and denoises one block of `canvas_length` tokens bidirectionally against it (its decoder; the
two share their weights). Every call here goes through `block_logits`:

    logits [B, CL, V] = model(input_ids=prefix, decoder_input_ids=canvas, ...).logits     (soft-capped, float32)

The prefix is left-padded (attention mask, positions counted from each row's first real token) and the canvas
takes the positions after it. There is no mask token: a canvas position is either clean or a uniformly random id.
The model's vision tower is part of the architecture but never sees an image here; it stays frozen.
"""
from __future__ import annotations

import re

from typing import Any

import torch
from pydantic import Field
from torch import Tensor, nn

from steadyrl.rollout.policy import load_tied_weights, lora_targets_by_type
from steadyrl.rollout.settings_base import StrictModel

# ids past the tokenizer's vocabulary that DiffusionGemma's config requires (image, begin- and end-of-image)
IMAGE_TOKENS = 3


class BlockDiffusionLMConfig(StrictModel):
    """A tiny DiffusionGemma: sliding-window layers and a last full-attention one (DiffusionGemma's last layer must
    be full), 2 experts per MoE layer (run as a loop over experts, `experts_implementation="eager"`: any dtype, the
    same sums on any thread count), a one-layer vision tower it never uses."""

    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1, description="the last one full attention, the others a sliding window")
    num_heads: int = Field(4, ge=1)
    head_dim: int = Field(32, ge=4)
    intermediate_size: int = Field(256, ge=8)
    num_experts: int = Field(2, ge=1, description="mixture-of-experts width of every layer (DiffusionGemma's MoE)")
    sliding_window: int = Field(16, ge=2)
    max_positions: int = Field(64, ge=8, description="longest prompt + completion")


def block_diffusion_lm_config(cfg: BlockDiffusionLMConfig, vocab_size: int, pad_id: int, eos_id: int,
                              canvas_length: int):
    """The transformers `DiffusionGemmaConfig` of the tiny model; its vocabulary is the tokenizer's plus the three
    image ids the config requires."""
    from transformers import DiffusionGemmaConfig

    vocab = vocab_size + IMAGE_TOKENS
    text = dict(vocab_size=vocab, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=1,
                head_dim=cfg.head_dim, global_head_dim=cfg.head_dim, num_global_key_value_heads=1,
                sliding_window=cfg.sliding_window,
                layer_types=["sliding_attention"] * (cfg.num_layers - 1) + ["full_attention"],
                num_experts=cfg.num_experts, top_k_experts=1, moe_intermediate_size=cfg.intermediate_size // 4,
                max_position_embeddings=cfg.max_positions, pad_token_id=pad_id, eos_token_id=eos_id,
                bos_token_id=None, experts_implementation="eager")
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=8)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=canvas_length,
                                  image_token_id=vocab_size, boi_token_id=vocab_size + 1,
                                  eoi_token_id=vocab_size + 2, pad_token_id=pad_id, eos_token_id=eos_id,
                                  experts_implementation="eager")
    config.architectures = ["DiffusionGemmaForBlockDiffusion"]
    return config


def freeze_vision(model: nn.Module) -> nn.Module:
    """The vision tower and its embedder never train (no image reaches them)."""
    for name, p in model.named_parameters():
        if _is_vision(name):
            p.requires_grad_(False)
    return model


def _is_vision(name: str) -> bool:
    return "vision_tower" in name or "embed_vision" in name


def build_block_diffusion_lm(cfg: BlockDiffusionLMConfig, vocab_size: int, pad_id: int, eos_id: int,
                             canvas_length: int) -> nn.Module:
    """A randomly initialised tiny DiffusionGemma (vision tower frozen)."""
    from transformers import DiffusionGemmaForBlockDiffusion

    config = block_diffusion_lm_config(cfg, vocab_size, pad_id, eos_id, canvas_length)
    return freeze_vision(DiffusionGemmaForBlockDiffusion(config))


def block_diffusion_lm_from_weights(cfg: BlockDiffusionLMConfig, vocab_size: int, pad_id: int, eos_id: int,
                                    canvas_length: int, weights: dict[str, Tensor]) -> nn.Module:
    """The tiny model of architecture `cfg` holding `weights` (e.g. from Ray's object store)."""
    model = build_block_diffusion_lm(cfg, vocab_size, pad_id, eos_id, canvas_length)
    model.load_state_dict(weights)
    return model.eval()


def load_pretrained_block_diffusion_lm(name_or_path: str, dtype: torch.dtype | None = None) -> nn.Module:
    """A real DiffusionGemma by hub id or local directory, in eval mode, its vision tower frozen."""
    from transformers import AutoConfig, DiffusionGemmaForBlockDiffusion

    config = AutoConfig.from_pretrained(name_or_path)
    if config.model_type != "diffusion_gemma":
        raise ValueError(f"testbed.pretrained={name_or_path!r} has model_type {config.model_type!r}; the arith_bd "
                         "testbed trains DiffusionGemma (model_type 'diffusion_gemma') block-diffusion models")
    kwargs: dict[str, Any] = {} if dtype is None else {"dtype": dtype}
    return freeze_vision(DiffusionGemmaForBlockDiffusion.from_pretrained(name_or_path, config=config, **kwargs).eval())


def pretrained_block_diffusion_architecture(name_or_path: str, weights: dict[str, Tensor]) -> nn.Module:
    """The architecture of `name_or_path` (its config only) holding `weights`."""
    from transformers import AutoConfig, DiffusionGemmaForBlockDiffusion

    model = DiffusionGemmaForBlockDiffusion(AutoConfig.from_pretrained(name_or_path))
    return freeze_vision(load_tied_weights(model, weights, name_or_path))


# LoRA targets: the attention projections and dense MLP of every (shared encoder/decoder) layer
DEFAULT_LORA_TARGETS = {"diffusion_gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj"]}


def block_diffusion_lora_targets(net, names: list[str] | None = None) -> str:
    """peft's regex (matched whole against each module's name) of the modules LoRA adapts in a DiffusionGemma:
    `names`, module-name suffixes (None: the defaults above), outside the vision tower, whose projections are
    wrapped linears peft cannot adapt and which never sees an image here."""
    names = names or lora_targets_by_type(net, DEFAULT_LORA_TARGETS)
    return rf"(?!.*(?:vision_tower|embed_vision)).*\.(?:{'|'.join(map(re.escape, names))})"


def canvas_positions(prefix_attention: Tensor, canvas_length: int) -> Tensor:
    """[B, CL] the canvas's position ids: right after each row's real prefix tokens."""
    real = prefix_attention.long().sum(dim=1, keepdim=True)
    return real + torch.arange(canvas_length, device=prefix_attention.device)


def block_logits(model, prefix: Tensor, prefix_attention: Tensor | None, canvas: Tensor,
                 self_conditioning: Tensor | None = None, self_conditioning_rows: Tensor | None = None) -> Tensor:
    """Soft-capped float32 logits [B, CL, V] of `canvas` [B, CL] denoised against the clean `prefix` [B, S]
    (left-padded where `prefix_attention` [B, S] is given); `self_conditioning`: the previous step's logits (applied
    to the rows `self_conditioning_rows` [B] only, when given)."""
    B, S = prefix.shape
    att = torch.ones(B, S, dtype=torch.long, device=prefix.device) if prefix_attention is None \
        else prefix_attention.long().to(prefix.device)
    decoder_att = torch.cat([att, att.new_ones(B, canvas.shape[1])], dim=1)
    return model(prefix, attention_mask=att, position_ids=(att.cumsum(dim=1) - 1).clamp(min=0),
                 decoder_input_ids=canvas, decoder_attention_mask=decoder_att,
                 decoder_position_ids=canvas_positions(att, canvas.shape[1]),
                 self_conditioning_logits=self_conditioning, self_conditioning_mask=self_conditioning_rows).logits
