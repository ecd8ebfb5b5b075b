"""The arith_bd testbed: the arith tasks for a block-diffusion LM (DiffusionGemma), sampled by steadyrl's own
block-diffusion sampler or vLLM's DiffusionGemma engine, with the same verifiers, services and learner as the other
language models. It is arith_ar with another model family: the hooks below, and the engine it builds."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field
from torch import Tensor, nn

from steadyrl.rollout.block_diffusion_lm import BlockDiffusionLMConfig
from steadyrl.services.testbeds.arith.autoregressive import ArithARSettings, ArithARTestbed
from steadyrl.services.testbeds.arith.pretrain_block_diffusion import BlockDiffusionPretrainConfig
from steadyrl.services.testbeds.arith.rest import ArithBDRequest
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


class ArithBDTestbed(ArithARTestbed):
    """A DiffusionGemma on the arith tasks; the exact verifier is reward and monitor (as `arith`)."""

    name = "arith_bd"
    Settings = ArithBDSettings
    rest = RestProfile("arith_bd", ArithBDRequest, items=True)
    settings: ArithBDSettings
    cache_tag = "bdlm"
    weights_file = "block_diffusion_lm.safetensors"

    # ------------------------------------------------------------------ the model family
    def _default_lora_targets(self, net: nn.Module) -> list[str]:
        from steadyrl.rollout.block_diffusion_lm import block_diffusion_lora_targets

        return block_diffusion_lora_targets(net)

    def _load_pretrained(self, dtype=None) -> nn.Module:
        from steadyrl.rollout.block_diffusion_lm import load_pretrained_block_diffusion_lm

        return load_pretrained_block_diffusion_lm(self.settings.pretrained, dtype)

    def _tiny_network(self, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.block_diffusion_lm import block_diffusion_lm_from_weights

        return block_diffusion_lm_from_weights(self.settings.model, len(TOKENIZER), TOKENIZER.pad_id,
                                               TOKENIZER.eos_id, self.cfg.sampler.block, weights)

    def _pretrained_architecture(self, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.block_diffusion_lm import pretrained_block_diffusion_architecture

        return pretrained_block_diffusion_architecture(self.settings.pretrained, weights)

    def _pretrain_tiny(self, progress: bool) -> Path:
        from steadyrl.services.testbeds.arith.pretrain_block_diffusion import ensure_pretrained_block_diffusion_lm

        a = self.settings
        return ensure_pretrained_block_diffusion_lm(self.task, a.model, self.cfg.sampler.block, a.pretrain, progress)

    def _sampler(self, cfg):
        """The block-diffusion sampler with the model's vocabulary size and the tokenizer's EOS and pad ids."""
        from steadyrl.rollout.sampler_factory import build_sampler

        codec = self.codec
        return build_sampler(cfg, eos_token_id=codec.eos_id, pad_token_id=codec.pad_id,
                             vocab_size=self.hf_config.get_text_config().vocab_size)

    def eval_sampler(self):
        """The training sampler: its commits are argmaxes already (only the canvas noise is random, seeded)."""
        return self._sampler(self.cfg.sampler)

    # ------------------------------------------------------------------ the vLLM backend
    @cached_property
    def hf_config(self):
        """The model's transformers config, without its weights: the tiny DiffusionGemma's, or the named model's."""
        a = self.settings
        if a.pretrained is None:
            from steadyrl.rollout.arith import TOKENIZER
            from steadyrl.rollout.block_diffusion_lm import block_diffusion_lm_config

            return block_diffusion_lm_config(a.model, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id,
                                             self.cfg.sampler.block)
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(a.pretrained)

    def _check_engine(self) -> None:
        """vLLM is installed and can sample a diffusion model on this machine."""
        from steadyrl.rollout.vllm_diffusion import check_diffusion_engine

        check_diffusion_engine(self.settings.pretrained or "the tiny DiffusionGemma")

    def _engine(self, weights: dict[str, Tensor], device) -> nn.Module:
        """vLLM's DiffusionGemma engine over the base model (with the sampler's generation_config.json), holding
        `weights` (the full weights, or the adapters)."""
        import tempfile

        from steadyrl.rollout.causal_lm import write_hf_checkpoint
        from steadyrl.rollout.vllm_diffusion import VLLMBlockDiffusionEngine, generation_config

        a, cfg = self.settings, self.cfg.sampler
        if a.pretrained is not None:  # the engine loads the named model itself (its own generation_config.json)
            model = a.pretrained
        else:
            net = self._base_network() if a.lora is not None else self._tiny_network(weights)
            model = str(write_hf_checkpoint(net, Path(tempfile.mkdtemp(prefix="steadyrl-vllm-model-")),
                                            generation_config(cfg)))
        targets = None if a.lora is None else a.lora.target_modules or self._default_lora_targets(self.hf_config)
        return VLLMBlockDiffusionEngine(model, cfg, self._max_model_len(), weights, a.lora, targets,
                                        device=str(device))
