"""The arith_bd testbed: the arith task (testbed.py) for a block-diffusion LM (a tiny DiffusionGemma pre-trained
here, or a real one by name), sampled by steadyrl's own block-diffusion sampler or vLLM's DiffusionGemma engine: its
settings and its model family."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field
from torch import Tensor, nn

from steadyrl.rollout.block_diffusion_lm import BlockDiffusionLMConfig
from steadyrl.services.testbeds.arith.autoregressive import ArithARSettings
from steadyrl.services.testbeds.arith.family import ModelFamily
from steadyrl.services.testbeds.arith.pretrain_block_diffusion import BlockDiffusionPretrainConfig
from steadyrl.services.testbeds.arith.rest import ArithBDRequest
from steadyrl.services.testbeds.arith.testbed import ArithTaskTestbed
from steadyrl.services.testbeds.rest import RestProfile

if TYPE_CHECKING:
    from steadyrl.services.config import TrainConfig


class ArithBDSettings(ArithARSettings):
    """The arith tasks for a block-diffusion LM: a tiny DiffusionGemma pre-trained here, or a real one by name."""

    name: Literal["arith_bd"] = "arith_bd"
    model: BlockDiffusionLMConfig = Field(default_factory=BlockDiffusionLMConfig)
    pretrain: BlockDiffusionPretrainConfig = Field(default_factory=BlockDiffusionPretrainConfig)
    pretrained: str | None = Field(
        None, description="a real DiffusionGemma by hub id or local directory (e.g. google/diffusiongemma-26B-A4B-it) "
        "with its own tokenizer, instead of the tiny model built here (`model`, `pretrain` then unused)")

    sampler_kinds: ClassVar[tuple[str, ...]] = ("block_diffusion",)

    def check(self, cfg: "TrainConfig") -> None:
        super().check(cfg)
        if cfg.sampler.backend == "vllm" and cfg.learner.max_staleness > 0:
            raise ValueError("sampler.backend=vllm with sampler.kind=block_diffusion cannot run asynchronously "
                             f"(learner.max_staleness={cfg.learner.max_staleness}): the engine's samples carry no "
                             "behaviour likelihood to weigh a lagged sample by; set learner.max_staleness=0")


class BlockDiffusionLM(ModelFamily):
    """A DiffusionGemma: blocks (canvases) of uniform noise denoised one after another over a causal prefix."""

    cache_tag = "bdlm"
    weights_file = "block_diffusion_lm.safetensors"
    greedy_eval = False  # the training sampler's commits are argmaxes already (only the canvas noise is random, seeded)
    export_tags = ("diffusion-lm", "block-diffusion")

    def lora_targets(self, net: Any, named: list[str] | None) -> str:
        from steadyrl.rollout.block_diffusion_lm import block_diffusion_lora_targets

        return block_diffusion_lora_targets(net, named)

    def load_pretrained(self, tb: ArithTaskTestbed, dtype=None) -> nn.Module:
        from steadyrl.rollout.block_diffusion_lm import load_pretrained_block_diffusion_lm

        return load_pretrained_block_diffusion_lm(tb.settings.pretrained, dtype)

    def tiny_network(self, tb: ArithTaskTestbed, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.block_diffusion_lm import block_diffusion_lm_from_weights

        return block_diffusion_lm_from_weights(tb.settings.model, len(TOKENIZER), TOKENIZER.pad_id,
                                               TOKENIZER.eos_id, tb.cfg.sampler.block, weights)

    def pretrained_architecture(self, tb: ArithTaskTestbed, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.block_diffusion_lm import pretrained_block_diffusion_architecture

        return pretrained_block_diffusion_architecture(tb.settings.pretrained, weights)

    def pretrain_tiny(self, tb: ArithTaskTestbed, progress: bool) -> Path:
        from steadyrl.services.testbeds.arith.pretrain_block_diffusion import ensure_pretrained_block_diffusion_lm

        a = tb.settings
        return ensure_pretrained_block_diffusion_lm(tb.task, a.model, tb.cfg.sampler.block, a.pretrain, progress)

    def sampler_options(self, tb: ArithTaskTestbed) -> dict[str, Any]:
        return {"vocab_size": tb.hf_config.get_text_config().vocab_size}

    def hf_config(self, tb: ArithTaskTestbed):
        """The tiny DiffusionGemma's config, or the named model's."""
        a = tb.settings
        if a.pretrained is None:
            from steadyrl.rollout.arith import TOKENIZER
            from steadyrl.rollout.block_diffusion_lm import block_diffusion_lm_config

            return block_diffusion_lm_config(a.model, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id,
                                             tb.cfg.sampler.block)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(a.pretrained)

    def check_engine(self, tb: ArithTaskTestbed) -> None:
        """vLLM is installed and can sample a diffusion model on this machine."""
        from steadyrl.rollout.vllm_diffusion import check_diffusion_engine

        check_diffusion_engine(tb.settings.pretrained or "the tiny DiffusionGemma")

    def generation_config(self, tb: ArithTaskTestbed) -> dict[str, Any]:
        """The sampler's settings, for the engine to read from the tiny base's checkpoint directory."""
        from steadyrl.rollout.vllm_diffusion import generation_config

        return generation_config(tb.cfg.sampler)

    def auto_class(self, tb: ArithTaskTestbed) -> str:
        return "AutoModelForImageTextToText"  # transformers registers DiffusionGemmaForBlockDiffusion there

    def export_generation(self, tb: ArithTaskTestbed) -> dict[str, Any]:
        """The sampler's settings as transformers' DiffusionGemmaGenerationConfig and vLLM read them
        (`generation_config`), with the completion length, EOS and pad ids (the canvas length is the model config's)."""
        return {**self.generation_config(tb), "max_new_tokens": tb.cfg.sampler.gen_length,
                "eos_token_id": tb.codec.eos_id, "pad_token_id": tb.codec.pad_id}

    def engine(self, tb: ArithTaskTestbed, model: str, weights: dict[str, Tensor], targets: list[str] | None,
               device) -> nn.Module:
        """vLLM's DiffusionGemma engine (a named model brings its own generation_config.json)."""
        from steadyrl.rollout.vllm_diffusion import VLLMBlockDiffusionEngine

        return VLLMBlockDiffusionEngine(model, tb.cfg.sampler, tb.max_model_len(), weights, tb.settings.lora, targets,
                                        device=str(device))


class ArithBDTestbed(ArithTaskTestbed):
    """A DiffusionGemma on the arith tasks; the exact verifier is reward and monitor (as `arith`)."""

    name = "arith_bd"
    Settings = ArithBDSettings
    rest = RestProfile("arith_bd", ArithBDRequest, items=True)
    family = BlockDiffusionLM()
