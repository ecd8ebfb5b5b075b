"""A tiny random LLaDA-interface model written to a local directory (the trust_remote_code route)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
AUTO_MAP = {"AutoConfig": "configuration_tiny_llada.TinyLLaDAConfig",
            "AutoModel": "modeling_tiny_llada.TinyLLaDAModelLM",
            "AutoModelForCausalLM": "modeling_tiny_llada.TinyLLaDAModelLM"}  # LLaDA's auto_map, our classes


def build_tiny_llada(seed: int = 0, **config_kwargs):
    """A random TinyLLaDAModelLM (eval mode), imported as the package `tiny_llada` would be."""
    import torch

    from tests.assets.tiny_llada.configuration_tiny_llada import TinyLLaDAConfig
    from tests.assets.tiny_llada.modeling_tiny_llada import TinyLLaDAModelLM

    torch.manual_seed(seed)
    return TinyLLaDAModelLM(TinyLLaDAConfig(**config_kwargs)).eval()


def write_tiny_llada(directory: str | Path, seed: int = 0, **config_kwargs):
    """Save a random tiny model to `directory` as a hub repo with remote code would be laid out:
    weights + config.json (with `auto_map`) + the two modelling files. Returns the in-memory model."""
    directory = Path(directory)
    model = build_tiny_llada(seed, **config_kwargs)
    model.save_pretrained(directory)
    for name in ("configuration_tiny_llada.py", "modeling_tiny_llada.py"):
        shutil.copyfile(HERE / name, directory / name)
    config_file = directory / "config.json"
    config = json.loads(config_file.read_text())
    config["auto_map"] = AUTO_MAP
    config_file.write_text(json.dumps(config, indent=2))
    return model


CHARS = list("0123456789+=|")


def write_char_tokenizer(directory: str | Path) -> None:
    """A character-level tokenizer (no download): [PAD]=0, [EOS]=1, [UNK]=2, then one id per character of
    the arith vocabulary (ids 3-15; a tiny LLaDA of vocabulary 24 with mask id 23 fits it)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[PAD]": 0, "[EOS]": 1, "[UNK]": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", eos_token="[EOS]",
                            unk_token="[UNK]").save_pretrained(directory)
