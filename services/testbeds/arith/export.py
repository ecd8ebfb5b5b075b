"""`steadyrl export` of an arith-family run (a masked-diffusion, autoregressive or block-diffusion LM): a model folder
transformers loads (every weight trained, or the LoRA adapters merged), or the adapters alone in peft's format over
their base (`testbed.pretrained`; the tiny base built here is written beside them, in base/). Every folder holds the
tokenizer (the arith characters as a transformers tokenizer with the same ids, or the named model's) and
generation_config.json with the run's sampler settings (the family's `export_generation`)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from torch import nn

from steadyrl.services.run_folder.model_card import ExportInfo

if TYPE_CHECKING:
    from steadyrl.services.testbeds.arith.testbed import ArithTaskTestbed

#: the folder of an adapters export that holds the tiny base model they adapt
BASE_FOLDER = "base"


def hf_tokenizer(tb: "ArithTaskTestbed"):
    """The run's tokenizer as transformers saves it: the arith characters (same ids; its mask token only for a family
    that masks), or the named model's own."""
    if tb.settings.pretrained is not None:
        return tb.codec.tokenizer
    from steadyrl.rollout.arith import EOS, MASK, PAD, TOKENIZER
    from steadyrl.rollout.hf_export import char_tokenizer

    return char_tokenizer(TOKENIZER.vocab, PAD, EOS, MASK if tb.mask_token_id is not None else None)


def export_language_model(tb: "ArithTaskTestbed", policy: nn.Module, out: Path, merge: bool) -> ExportInfo:
    """Write `policy` (a checkpoint's, `tb.build_policy`) into the empty folder `out`: adapters when the run trained
    LoRA and `merge` is off, else a whole model folder (merging fuses the adapters into `policy` in place)."""
    from steadyrl.rollout.hf_export import merge_lora, save_model_folder, save_tokenizer

    a, family = tb.settings, tb.family
    net, tokenizer, generation = getattr(policy, "net", policy), hf_tokenizer(tb), family.export_generation(tb)
    auto, remote = family.auto_class(tb), ", trust_remote_code=True" if a.trust_remote_code else ""
    if a.lora is None or merge:
        save_model_folder(net if a.lora is None else merge_lora(net), out, tokenizer, generation)
        trained = "every weight trained" if a.lora is None else "the LoRA adapters merged into the base"
        return ExportInfo(
            format=f"a transformers model folder for {auto} ({trained}) with its tokenizer and generation_config.json "
                   "(the run's sampler settings)",
            library="transformers", base_model=a.pretrained, tags=family.export_tags,
            load=f'from transformers import AutoTokenizer, {auto}\n\nmodel = {auto}.from_pretrained("{{path}}"'
                 f'{remote})\ntokenizer = AutoTokenizer.from_pretrained("{{path}}"{remote})\n')
    write_adapters(tb, policy, out)
    save_tokenizer(tokenizer, out)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    if a.pretrained is None:
        save_model_folder(tb._base_network(), out / BASE_FOLDER, tokenizer, generation)
    base = a.pretrained or f"{{path}}/{BASE_FOLDER}"
    where = (f"over the base `{a.pretrained}`" if a.pretrained else
             f"over the tiny base model in {BASE_FOLDER}/ (adapter_config.json names it relative to this folder)")
    return ExportInfo(
        format=f"LoRA adapters in peft's format (adapter_config.json + adapter_model.safetensors) {where}, with the "
               "tokenizer and generation_config.json (the run's sampler settings)",
        library="peft", base_model=a.pretrained, tags=family.export_tags,
        load=f'from peft import PeftModel\nfrom transformers import AutoTokenizer, {auto}\n\n'
             f'base = {auto}.from_pretrained("{base}"{remote})\nmodel = PeftModel.from_pretrained(base, "{{path}}")\n'
             f'tokenizer = AutoTokenizer.from_pretrained("{{path}}"{remote})\n')


def write_adapters(tb: "ArithTaskTestbed", policy: nn.Module, out: Path) -> Path:
    """The policy's LoRA adapters as peft writes them, adapter_config.json naming the base
    (`base_model_name_or_path`: `testbed.pretrained`, or base/)."""
    from steadyrl.rollout.causal_lm import write_peft_adapter

    a, family = tb.settings, tb.family
    targets = family.lora_targets(policy.net, a.lora.target_modules)
    return write_peft_adapter(policy.trainable_state_dict(), a.lora.rank, a.lora.alpha, targets, out,
                              base_model=a.pretrained or BASE_FOLDER, task_type=family.peft_task_type,
                              dropout=a.lora.dropout)
