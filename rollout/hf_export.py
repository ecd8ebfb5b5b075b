"""A trained transformers model as a folder the ecosystem loads (`steadyrl export`): the whole model with its
tokenizer and generation settings (`save_model_folder`), LoRA adapters fused into it first (`merge_lora`), and a
transformers tokenizer over a character vocabulary (`char_tokenizer`: the arith tokenizer's ids, unchanged).
Adapters alone are written by `rollout.causal_lm.write_peft_adapter`; `save_tokenizer` names a generic fast tokenizer
as transformers 4 and 5 both load it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

from torch import nn

#: config.json keys of the kernels a model computes with, which `from_pretrained` reads and `save_pretrained` drops
IMPLEMENTATIONS = ("attn_implementation", "experts_implementation")


def char_tokenizer(vocab: Sequence[str], pad: str, eos: str, mask: str | None = None):
    """A `PreTrainedTokenizerFast` giving each character its index in `vocab` (special tokens included), adding
    no special tokens on encode; `pad`, `eos` and `mask` are its special tokens (`skip_special_tokens` drops them).
    A character outside `vocab` is an error, as it is for the arith `CharTokenizer`."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, eos_token=eos,
                                   **({} if mask is None else {"mask_token": mask}))


class NotMergeable(ValueError):
    """Adapters that no single set of merged weights reproduces."""


def merge_lora(net: nn.Module) -> nn.Module:
    """`net` with every LoRA adapter (injected by peft, `rollout.lora.add_lora`) fused into its base layer by peft's
    own merge (W + alpha / r B A, in the base layer's dtype) and the plain layer put back: the architecture without
    peft. In place; returns `net`. `NotMergeable`, before anything changes, where two adapted layers share one base
    weight (a DiffusionGemma's decoder reuses its encoder's layers' weights): each use has its own B A, and one
    merged W + B A cannot be both."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    tuned = [(name, m) for name, m in net.named_modules() if isinstance(m, BaseTunerLayer)]
    owners: dict[int, str] = {}
    for name, module in tuned:
        first = owners.setdefault(id(module.get_base_layer().weight), name)
        if first != name:
            raise NotMergeable(f"the adapted layers {first} and {name} share one base weight, each with its own "
                               "adapters: no merged weight computes both")
    for name, module in tuned:
        module.merge()
        parent, _, attr = name.rpartition(".")
        setattr(net.get_submodule(parent), attr, module.get_base_layer())
    if hasattr(net, "peft_config"):  # the injection's record: the merged model has no adapters
        del net.peft_config
    return net


def save_model_folder(net: nn.Module, out: Path, tokenizer: Any = None,
                      generation: dict[str, Any] | None = None) -> Path:
    """`net` (a transformers model without adapters) as `save_pretrained` writes it (config.json, model.safetensors;
    a remote-code model's modelling files), with the attention and mixture-of-experts implementations it ran with
    recorded in config.json (`save_pretrained` leaves them out, and `from_pretrained` would pick sdpa attention and
    grouped experts: other sums than the run's eager ones; a caller may still ask for others), `tokenizer`'s files,
    and generation_config.json holding `generation` when given."""
    out = Path(out)
    net.save_pretrained(out)
    ran_with = {key: getattr(net.config, f"_{key}", None) for key in IMPLEMENTATIONS}
    ran_with = {k: v for k, v in ran_with.items() if v is not None}
    if ran_with:
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, **ran_with}, indent=2) + "\n")
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    if generation is not None:
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def save_tokenizer(tokenizer: Any, out: Path) -> Path:
    """`tokenizer.save_pretrained(out)`, its class named as transformers 4 and 5 both load it: transformers 5 writes
    a generic fast tokenizer as "TokenizersBackend", a name transformers 4 does not know; "PreTrainedTokenizerFast"
    loads the same tokenizer.json in either."""
    out = Path(out)
    tokenizer.save_pretrained(out)
    path = out / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.exists() else {}
    if config.get("tokenizer_class") == "TokenizersBackend":
        path.write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")
    return out
