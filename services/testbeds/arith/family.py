"""A model family of the arith testbeds: what differs between a masked-diffusion, an autoregressive and a
block-diffusion LM on the same task (`testbed.ArithTaskTestbed` holds the rest)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor, nn

if TYPE_CHECKING:
    from steadyrl.services.testbeds.arith.testbed import ArithTaskTestbed


class ModelFamily:
    """One kind of language model: how it is built, pre-trained, adapted and sampled. Every hook gets the testbed
    (its `settings`, `cfg`, `task`, `codec`). The defaults are a family without a mask token or an inference
    engine, evaluated greedily."""

    #: names the cache folders of a named model's weights and of LoRA's initial adapters
    cache_tag: ClassVar[str]
    #: the file name of a named model's weights copied into the cache
    weights_file: ClassVar[str]
    #: evaluations decode at temperature 0 (else with the training sampler)
    greedy_eval: ClassVar[bool] = True
    #: peft's task type of exported adapters (None: a plain `PeftModel`, for a model that is not a causal LM)
    peft_task_type: ClassVar[str | None] = None
    #: the model card's tags of an export (besides steadyrl's, the objective's and the testbed's)
    export_tags: ClassVar[tuple[str, ...]] = ()

    def mask_token_id(self, tb: "ArithTaskTestbed") -> int | None:
        """The tokenizer's mask token (None: nothing is masked)."""
        return None

    def lora_targets(self, net: Any, named: list[str] | None) -> list[str] | str:
        """The modules LoRA adapts, as peft's `target_modules` (suffixes, or a regex): `named`
        (`lora.target_modules`), else the family's default for `net` (the model or its config)."""
        raise NotImplementedError

    def load_pretrained(self, tb: "ArithTaskTestbed", dtype=None) -> nn.Module:
        """The named model (`pretrained`) with its weights, from the hub cache or a directory."""
        raise NotImplementedError

    def tiny_network(self, tb: "ArithTaskTestbed", weights: dict[str, Tensor]) -> nn.Module:
        """The tiny model built here, holding `weights`."""
        raise NotImplementedError

    def pretrained_architecture(self, tb: "ArithTaskTestbed", weights: dict[str, Tensor]) -> nn.Module:
        """The named model's architecture (config only) holding `weights`."""
        raise NotImplementedError

    def pretrain_tiny(self, tb: "ArithTaskTestbed", progress: bool) -> Path:
        """The tiny model's pre-trained weights (cached; rebuilt bitwise where the cache is empty)."""
        raise NotImplementedError

    def sampler_options(self, tb: "ArithTaskTestbed") -> dict[str, Any]:
        """`build_sampler`'s arguments besides the config and the EOS and pad ids."""
        return {}

    # ------------------------------------------------------------------ export (`steadyrl export`, export.py)
    def auto_class(self, tb: "ArithTaskTestbed") -> str:
        """The transformers Auto class that loads an exported model folder."""
        raise NotImplementedError

    def export_generation(self, tb: "ArithTaskTestbed") -> dict[str, Any]:
        """generation_config.json of an export: the sampler settings the run used, with its EOS and pad ids."""
        raise NotImplementedError

    # ------------------------------------------------------------------ an inference engine (sampler.backend=vllm)
    def hf_config(self, tb: "ArithTaskTestbed"):
        """The model's transformers config, without its weights."""
        raise NotImplementedError(f"{type(self).__name__} has no inference engine")

    def check_engine(self, tb: "ArithTaskTestbed") -> None:
        """The engine is installed and serves the model."""
        raise NotImplementedError(f"{type(self).__name__} has no inference engine")

    def generation_config(self, tb: "ArithTaskTestbed") -> dict[str, Any] | None:
        """generation_config.json of the tiny base's checkpoint directory (None: none written)."""
        return None

    def engine(self, tb: "ArithTaskTestbed", model: str, weights: dict[str, Tensor], targets: list[str] | None,
               device) -> nn.Module:
        """The engine over `model` (hub id or directory), holding `weights` (LoRA on `targets` if set)."""
        raise NotImplementedError(f"{type(self).__name__} has no inference engine")
