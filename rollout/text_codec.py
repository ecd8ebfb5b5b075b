"""Text <-> token ids for the dLLM testbeds: the arith character tokenizer, or a real model's tokenizer.

Both expose the same small interface, so the prompts, the verifier and the evaluation never care
which one is in use:  encode(text) -> ids,  decode(ids) -> text up to the first <eos>,  eos_id,
pad_id,  mask_token_id,  len().
"""
from __future__ import annotations

from typing import Protocol, Sequence

from torch import Tensor


class TextCodec(Protocol):
    eos_id: int
    pad_id: int
    mask_token_id: int

    def __len__(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int] | Tensor, stop_at_eos: bool = True) -> str: ...


class HFTokenizerCodec:
    """A transformers tokenizer behind the `TextCodec` interface (no special tokens added on encode;
    special tokens dropped on decode, which stops at the first <eos>)."""

    def __init__(self, name_or_path: str, trust_remote_code: bool = False, mask_token_id: int | None = None,
                 eos_token_id: int | None = None, pad_token_id: int | None = None):
        """EOS: `eos_token_id`, else the tokenizer's eos (or sep) token; pad: `pad_token_id`, else the tokenizer's
        pad token, else the EOS (as d1 and SPG/StableDRL set it)."""
        from transformers import AutoTokenizer

        self.name = name_or_path
        self.tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
        tok = self.tokenizer
        mask = mask_token_id if mask_token_id is not None else tok.mask_token_id
        eos = next((i for i in (eos_token_id, tok.eos_token_id, tok.sep_token_id) if i is not None), None)
        if eos is None:
            raise ValueError(f"tokenizer of {name_or_path!r} declares no EOS (or sep) token to end a completion with: "
                             "name its id with testbed.eos_token_id")
        self.mask_token_id = -1 if mask is None else int(mask)  # LLaDA: in the model config, not the tokenizer
        self.eos_id = int(eos)
        pad = next((i for i in (pad_token_id, tok.pad_token_id) if i is not None), self.eos_id)
        self.pad_id = int(pad)

    def __len__(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int] | Tensor, stop_at_eos: bool = True) -> str:
        ids = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        if stop_at_eos and self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True).strip()


def load_codec(tokenizer: str | None, trust_remote_code: bool = False, mask_token_id: int | None = None,
               eos_token_id: int | None = None, pad_token_id: int | None = None) -> TextCodec:
    """The arith character tokenizer (None), or a real model's tokenizer by hub id / local directory (EOS and
    pad ids overridable: `HFTokenizerCodec`)."""
    if tokenizer is None:
        from steadyrl.rollout.arith import TOKENIZER

        return TOKENIZER
    return HFTokenizerCodec(tokenizer, trust_remote_code, mask_token_id, eos_token_id, pad_token_id)
