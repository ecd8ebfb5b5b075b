"""The arith_ar testbed: the arith task (testbed.py) for an autoregressive LM (a tiny Llama pre-trained here, or any
causal LM by name), sampled token by token by the transformers loop or a vLLM engine: its settings and its model
family."""
from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field
from torch import Tensor, nn

from steadyrl.rollout.causal_lm import CausalLMConfig
from steadyrl.services.testbeds.arith.family import ModelFamily
from steadyrl.services.testbeds.arith.masked import ArithSettings
from steadyrl.services.testbeds.arith.pretrain_causal_lm import CausalLMPretrainConfig
from steadyrl.services.testbeds.arith.rest import ArithARRequest
from steadyrl.services.testbeds.arith.testbed import ArithTaskTestbed
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


class CausalLM(ModelFamily):
    """A causal LM (transformers' AutoModelForCausalLM), served by vLLM with sampler.backend=vllm."""

    cache_tag = "clm"
    weights_file = "causal_lm.safetensors"
    peft_task_type = "CAUSAL_LM"
    export_tags = ("text-generation",)

    def lora_targets(self, net: Any, named: list[str] | None) -> list[str]:
        from steadyrl.rollout.causal_lm import causal_lora_targets

        return named or causal_lora_targets(net)

    def load_pretrained(self, tb: ArithTaskTestbed, dtype=None) -> nn.Module:
        from steadyrl.rollout.causal_lm import load_pretrained_causal_lm

        a = tb.settings
        return load_pretrained_causal_lm(a.pretrained, a.trust_remote_code, dtype)

    def tiny_network(self, tb: ArithTaskTestbed, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.causal_lm import causal_lm_from_weights

        return causal_lm_from_weights(tb.settings.model, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id, weights)

    def pretrained_architecture(self, tb: ArithTaskTestbed, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.causal_lm import pretrained_causal_architecture

        a = tb.settings
        return pretrained_causal_architecture(a.pretrained, weights, a.trust_remote_code)

    def pretrain_tiny(self, tb: ArithTaskTestbed, progress: bool) -> Path:
        from steadyrl.services.testbeds.arith.pretrain_causal_lm import ensure_pretrained_causal_lm

        a = tb.settings
        return ensure_pretrained_causal_lm(tb.task, a.model, a.pretrain, progress)

    def auto_class(self, tb: ArithTaskTestbed) -> str:
        return "AutoModelForCausalLM"

    def export_generation(self, tb: ArithTaskTestbed) -> dict[str, Any]:
        """What transformers' `generate` and vLLM read: the completion length, EOS and pad ids, and the run's
        temperature over the whole vocabulary (no top-k / top-p), or greedy decoding at temperature 0."""
        s = tb.cfg.sampler
        sampled = {"temperature": s.temperature, "top_k": 0, "top_p": 1.0} if s.temperature > 0 else {}
        return {"max_new_tokens": s.gen_length, "eos_token_id": tb.codec.eos_id, "pad_token_id": tb.codec.pad_id,
                "do_sample": s.temperature > 0, **sampled}

    def hf_config(self, tb: ArithTaskTestbed):
        """The tiny Llama's config, or the named model's."""
        a = tb.settings
        if a.pretrained is None:
            from steadyrl.rollout.arith import TOKENIZER
            from steadyrl.rollout.causal_lm import causal_lm_config

            config = causal_lm_config(a.model, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id)
            config.architectures = ["LlamaForCausalLM"]
            return config
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(a.pretrained, trust_remote_code=a.trust_remote_code)

    def check_engine(self, tb: ArithTaskTestbed) -> None:
        """vLLM is installed and implements the model's architecture."""
        from steadyrl.rollout.vllm_engine import check_servable, require_vllm

        require_vllm()
        check_servable(tb.hf_config.architectures, tb.settings.pretrained or "the tiny Llama")

    def engine(self, tb: ArithTaskTestbed, model: str, weights: dict[str, Tensor], targets: list[str] | None,
               device) -> nn.Module:
        """A vLLM engine."""
        from steadyrl.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(model, tb.cfg.sampler.vllm, tb.max_model_len(), weights, tb.hf_config.architectures,
                          tb.settings.lora, targets, device=str(device))


class ArithARTestbed(ArithTaskTestbed):
    """A causal LM on the arith tasks; the exact verifier is reward and monitor (as `arith`)."""

    name = "arith_ar"
    Settings = ArithARSettings
    rest = RestProfile("arith_ar", ArithARRequest, items=True)
    family = CausalLM()
