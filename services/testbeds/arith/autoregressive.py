"""The arith_ar testbed: the arith tasks (synthetic addition and sudoku, task files) for an autoregressive LM, sampled
by the transformers loop or a vLLM engine, with the same verifiers, services and learner as the masked-diffusion LMs."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field
from torch import Tensor, nn

from steadyrl.rollout.causal_lm import CausalLMConfig
from steadyrl.services.testbeds.arith.masked import ArithSettings, ArithTestbed
from steadyrl.services.testbeds.arith.pretrain_causal_lm import CausalLMPretrainConfig
from steadyrl.services.testbeds.arith.rest import ArithARRequest
from steadyrl.services.testbeds.rest import RestProfile


class ArithARSettings(ArithSettings):
    """The arith tasks for a causal LM: a tiny Llama pre-trained here, or a real causal LM by name."""

    name: Literal["arith_ar"] = "arith_ar"
    model: CausalLMConfig = Field(default_factory=CausalLMConfig)
    pretrain: CausalLMPretrainConfig = Field(default_factory=CausalLMPretrainConfig)
    pretrained: str | None = Field(
        None, description="a real causal LM by hub id or local directory (any AutoModelForCausalLM; for "
        "sampler.backend=vllm, a family vLLM serves) with its own tokenizer, instead of the tiny Llama built here "
        "(`model`, `pretrain` then unused)")
    trust_remote_code: bool = Field(False, description="run the model repo's own modelling code")

    sampler_kinds: ClassVar[tuple[str, ...]] = ("autoregressive",)


class ArithARTestbed(ArithTestbed):
    """A causal LM on the arith tasks; the exact verifier is reward and monitor (as `arith`)."""

    name = "arith_ar"
    Settings = ArithARSettings
    rest = RestProfile("arith_ar", ArithARRequest, items=True)
    settings: ArithARSettings
    cache_tag = "clm"
    weights_file = "causal_lm.safetensors"

    # ------------------------------------------------------------------ the model family
    @cached_property
    def codec(self):
        """The character tokenizer, or the real model's (no mask token: nothing is masked)."""
        from steadyrl.rollout.text_codec import load_codec

        a = self.settings
        return load_codec(a.pretrained, a.trust_remote_code, None, a.eos_token_id, a.pad_token_id)

    def _default_lora_targets(self, net: nn.Module) -> list[str]:
        from steadyrl.rollout.causal_lm import causal_lora_targets

        return causal_lora_targets(net)

    def _load_pretrained(self, dtype=None) -> nn.Module:
        from steadyrl.rollout.causal_lm import load_pretrained_causal_lm

        a = self.settings
        return load_pretrained_causal_lm(a.pretrained, a.trust_remote_code, dtype)

    def _tiny_network(self, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.causal_lm import causal_lm_from_weights

        return causal_lm_from_weights(self.settings.model, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id, weights)

    def _pretrained_architecture(self, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.causal_lm import pretrained_causal_architecture

        a = self.settings
        return pretrained_causal_architecture(a.pretrained, weights, a.trust_remote_code)

    def _pretrain_tiny(self, progress: bool) -> Path:
        from steadyrl.services.testbeds.arith.pretrain_causal_lm import ensure_pretrained_causal_lm

        a = self.settings
        return ensure_pretrained_causal_lm(self.task, a.model, a.pretrain, progress)

    def _sampler(self, cfg):
        """The autoregressive sampler with the tokenizer's EOS and pad ids."""
        from steadyrl.rollout.sampler_factory import build_sampler

        codec = self.codec
        return build_sampler(cfg, eos_token_id=codec.eos_id, pad_token_id=codec.pad_id)

    # ------------------------------------------------------------------ the vLLM backend
    @property
    def uses_vllm(self) -> bool:
        return self.cfg.sampler.backend == "vllm"

    @cached_property
    def hf_config(self):
        """The model's transformers config, without its weights: the tiny Llama's, or the named model's."""
        a = self.settings
        if a.pretrained is None:
            from steadyrl.rollout.arith import TOKENIZER
            from steadyrl.rollout.causal_lm import causal_lm_config

            config = causal_lm_config(a.model, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id)
            config.architectures = ["LlamaForCausalLM"]
            return config
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(a.pretrained, trust_remote_code=a.trust_remote_code)

    def preflight(self) -> None:
        """As arith's, and for sampler.backend=vllm: vLLM is installed and implements the model's architecture."""
        super().preflight()
        if self.uses_vllm:
            self._check_engine()

    def _check_engine(self) -> None:
        """vLLM is installed and implements the model's architecture."""
        from steadyrl.rollout.vllm_engine import check_servable, require_vllm

        require_vllm()
        check_servable(self.hf_config.architectures, self.settings.pretrained or "the tiny Llama")

    def _max_model_len(self) -> int:
        a = self.settings
        if a.pretrained is None:
            return a.model.max_positions
        return (self.file_task.width if a.task == "file" else a.max_prompt_length) + self.cfg.sampler.gen_length

    def build_rollout_policy(self, weights: dict[str, Tensor], device) -> nn.Module:
        """transformers: the policy on `device`; vllm: an engine holding the base model and `weights` (the full
        weights, or the adapters)."""
        if not self.uses_vllm:
            return super().build_rollout_policy(weights, device)
        return self._engine(weights, device)

    def _engine(self, weights: dict[str, Tensor], device) -> nn.Module:
        """The vLLM engine over the base model, holding `weights`."""
        import tempfile

        from steadyrl.rollout.causal_lm import write_hf_checkpoint
        from steadyrl.rollout.vllm_engine import VLLMEngine

        a = self.settings
        if a.pretrained is not None:  # the engine loads the named model itself
            model = a.pretrained
        else:  # the tiny base as a checkpoint directory the engine reads
            net = self._base_network() if a.lora is not None else self._tiny_network(weights)
            model = str(write_hf_checkpoint(net, Path(tempfile.mkdtemp(prefix="steadyrl-vllm-model-"))))
        targets = None if a.lora is None else a.lora.target_modules or self._default_lora_targets(self.hf_config)
        return VLLMEngine(model, self.cfg.sampler.vllm, self._max_model_len(), weights, self.hf_config.architectures,
                          a.lora, targets, device=str(device))
