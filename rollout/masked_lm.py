"""Masked-diffusion language models: the arith testbed's tiny BERT, and real models by name.

Every masked-diffusion LM the samplers see is called as `model(input_ids).logits` ([B, S, V]) with
bidirectional attention, and has a mask token id; nothing else is assumed (LLaDA's interface).
"""
from __future__ import annotations

from typing import Any, Protocol

import torch
from pydantic import Field
from torch import Tensor, nn

from steadyrl.rollout.policy import check_lm_family, load_tied_weights, lora_targets_by_type
from steadyrl.rollout.settings_base import StrictModel


class MaskedLM(Protocol):
    def __call__(self, input_ids: Tensor) -> Any: ...  # `.logits` [B, S, V]


class MaskedLMConfig(StrictModel):
    """A tiny transformers `BertForMaskedLM` (bidirectional attention), about 0.8 M parameters by default.
    Dropout is off: the log-prob recompute must equal sampling's numbers exactly."""

    hidden_size: int = Field(128, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(4, ge=1)
    intermediate_size: int = Field(256, ge=8)
    max_positions: int = Field(64, ge=8, description="longest prompt + completion")


def build_masked_lm(cfg: MaskedLMConfig, vocab_size: int, pad_id: int = 0) -> nn.Module:
    """A randomly initialised BertForMaskedLM of this size."""
    from transformers import BertConfig, BertForMaskedLM

    if cfg.hidden_size % cfg.num_heads:
        raise ValueError(f"model.hidden_size={cfg.hidden_size} must be a multiple of num_heads={cfg.num_heads}")
    config = BertConfig(
        vocab_size=vocab_size, hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions, type_vocab_size=1, pad_token_id=pad_id,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager",
        tie_word_embeddings=False)  # untied: state dicts hold no aliased tensors (safetensors, weight sync)
    return BertForMaskedLM(config)


# LoRA targets per model type (module-name suffixes; peft adapts every linear layer whose name ends in one):
#   bert   the self-attention projections
#   llada  d1's list (dllm-reasoning/d1, diffu-grpo/diffu_grpo_train.py): LLaDA's blocks name q_proj, k_proj, v_proj
#          and up_proj among them (its output and MLP-out projections are attn_out, ff_proj, ff_out)
DEFAULT_LORA_TARGETS = {
    "bert": ["query", "key", "value"],
    "llada": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "gate_proj"],
}


def lora_targets(net: nn.Module) -> list[str]:
    """The default LoRA target modules of a masked LM, by its config's model type."""
    return lora_targets_by_type(net, DEFAULT_LORA_TARGETS)


def masked_lm_from_weights(cfg: MaskedLMConfig, vocab_size: int, weights: dict[str, Tensor]) -> nn.Module:
    """A tiny masked LM of architecture `cfg` holding `weights` (e.g. from Ray's object store)."""
    model = build_masked_lm(cfg, vocab_size)
    model.load_state_dict(weights)
    return model.eval()


# auto_map entries of remote modelling code, best first: a masked-LM head, else the LM class LLaDA registers
# (AutoModel and AutoModelForCausalLM both name LLaDAModelLM, which returns full-sequence logits)
_REMOTE_AUTO_CLASSES = ("AutoModelForMaskedLM", "AutoModelForCausalLM", "AutoModel")


def resolve_pretrained_masked_lm(name_or_path: str, trust_remote_code: bool = False) -> tuple[Any, Any, int]:
    """(config, the transformers Auto class that builds it, mask token id) of a real masked-diffusion LM,
    without loading its weights.

    Two routes, both called as `model(input_ids).logits` by the samplers:
      remote code   LLaDA-style repos ship their modelling files and name them in config.json's `auto_map`
                    (LLaDA: AutoConfig, AutoModel, AutoModelForCausalLM); loading runs that code, so it
                    needs `trust_remote_code=True`. The class is the auto_map's AutoModelForMaskedLM, else
                    AutoModelForCausalLM, else AutoModel.
      native        a model type transformers implements as a masked LM loads through AutoModelForMaskedLM.
    The mask token id is the config's `mask_token_id` (LLaDA: 126336), else the tokenizer's. Offline runs
    (`HF_HUB_OFFLINE=1`) need a local path or a filled cache.
    """
    import transformers
    from transformers import AutoConfig, AutoModelForMaskedLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING

    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except ValueError as err:
        if "trust_remote_code" not in str(err) or trust_remote_code:
            raise
        raise ValueError(f"model {name_or_path!r} ships its own modelling code (config.json `auto_map`, as LLaDA "
                         "does): loading it runs that code, so pass trust_remote_code=True if you trust "
                         "it") from err
    check_lm_family(config, name_or_path)
    auto_map = getattr(config, "auto_map", None) or {}
    remote = [name for name in _REMOTE_AUTO_CLASSES if name in auto_map] if trust_remote_code else []
    if remote:
        loader = getattr(transformers, remote[0])
    elif type(config) in MODEL_FOR_MASKED_LM_MAPPING:
        loader = AutoModelForMaskedLM
    else:
        hint = (" (its auto_map names no AutoModelForMaskedLM / AutoModelForCausalLM / AutoModel)"
                if trust_remote_code and auto_map else
                "; LLaDA-style models with their own code need trust_remote_code=True" if auto_map else "")
        raise ValueError(f"model {name_or_path!r} (model_type {getattr(config, 'model_type', None)!r}) is neither a "
                         f"masked LM transformers implements (AutoModelForMaskedLM) nor remote modelling code{hint}")
    mask_id = getattr(config, "mask_token_id", None)
    if mask_id is None:
        mask_id = _tokenizer_mask_id(name_or_path, trust_remote_code)
    if mask_id is None:
        raise ValueError(f"model {name_or_path!r} declares no mask token id (neither config.mask_token_id nor its "
                         "tokenizer's mask_token_id): it is not a masked-diffusion LM")
    vocab = getattr(config, "vocab_size", None)
    if isinstance(vocab, int) and not 0 <= int(mask_id) < vocab:
        raise ValueError(f"model {name_or_path!r}: mask token id {mask_id} is outside its vocabulary ({vocab})")
    return config, loader, int(mask_id)


def load_pretrained_masked_lm(name_or_path: str, trust_remote_code: bool = False,
                              dtype: torch.dtype | None = None) -> tuple[nn.Module, int]:
    """(model in eval mode, mask token id) of a real masked-diffusion LM, by hub id or local directory
    (`resolve_pretrained_masked_lm` says how; the mask id is settled before the weights load)."""
    config, loader, mask_id = resolve_pretrained_masked_lm(name_or_path, trust_remote_code)
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        kwargs["dtype"] = dtype
    model = loader.from_pretrained(name_or_path, config=config, **kwargs)
    return model.eval(), mask_id


def pretrained_architecture_with_weights(name_or_path: str, weights: dict[str, Tensor],
                                         trust_remote_code: bool = False) -> nn.Module:
    """The architecture of `name_or_path` (its config only: no weight download) holding `weights`, e.g. a
    state dict that came through Ray's object store."""
    config, loader, _ = resolve_pretrained_masked_lm(name_or_path, trust_remote_code)
    return load_tied_weights(loader.from_config(config, trust_remote_code=trust_remote_code), weights, name_or_path)


def _tokenizer_mask_id(name_or_path: str, trust_remote_code: bool) -> int | None:
    """The tokenizer's mask token id; None when the repo has no tokenizer files or no mask token.
    (transformers 5 builds an empty default tokenizer, with a made-up [MASK] id, for a repo without one.)"""
    from transformers import AutoTokenizer
    from transformers.utils.hub import cached_file

    if not any(cached_file(name_or_path, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
               for name in ("tokenizer_config.json", "tokenizer.json")):
        return None
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, KeyError, TypeError):  # unreadable files, or an unknown tokenizer class
        return None
    return getattr(tokenizer, "mask_token_id", None)
