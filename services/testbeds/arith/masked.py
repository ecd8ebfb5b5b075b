"""The arith testbed: the arith task (testbed.py) for a masked-diffusion LM (a tiny BERT pre-trained here, or a
real one by name such as LLaDA), denoised from fully masked completions: its settings and its model family."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator
from torch import Tensor, nn

from steadyrl.reward.config import check_weighting
from steadyrl.reward.python_reward import named_score_columns
from steadyrl.reward.user_rewards import UserRewardSpec
from steadyrl.reward.weighting import RewardWeighting
from steadyrl.rollout.lora import LoRAConfig
from steadyrl.rollout.masked_lm import MaskedLMConfig
from steadyrl.rollout.task_file_dataset import FileTaskSettings
from steadyrl.services.testbeds.arith.family import ModelFamily
from steadyrl.services.testbeds.arith.pretrain_masked_lm import MaskedLMPretrainConfig
from steadyrl.services.testbeds.arith.rest import ArithRequest, TextScoreRequest
from steadyrl.services.testbeds.arith.testbed import ArithTaskTestbed
from steadyrl.services.testbeds.rest import RestProfile
from steadyrl.services.testbeds.settings import TestbedSettings

if TYPE_CHECKING:
    from steadyrl.services.config import TrainConfig


class ArithSettings(TestbedSettings):
    """The arith testbed: synthetic problems, a tiny masked-diffusion LM (or a real one by name), an exact
    verifier."""

    name: Literal["arith"] = "arith"
    task: Literal["addition", "sudoku", "file"] = Field(
        "addition", description="addition / sudoku: synthetic problems; file: rows of a task file (`file`), e.g. "
        "GSM8K-style math, countdown or sudoku, with the model's chat template and a verifier per kind")
    file: FileTaskSettings | None = Field(None, description="task=file: the task file, its prompts and verifier")
    max_prompt_length: int = Field(512, ge=1, description="task=file: a longer prompt (in tokens) is an error "
                                   "naming its row, raised before Ray starts")
    digits: int = Field(2, ge=1, le=8, description="addition: operand digits (zero-padded in the prompt)")
    blanks: int = Field(6, ge=1, le=16, description="sudoku: hidden cells of the 4x4 grid")
    model: MaskedLMConfig = Field(default_factory=MaskedLMConfig)
    pretrain: MaskedLMPretrainConfig = Field(default_factory=MaskedLMPretrainConfig)
    pretrained: str | None = Field(
        None, description="a real masked-diffusion LM by hub id or local directory (LLaDA, or any masked LM "
        "transformers implements) with its own tokenizer, instead of the tiny BERT built here (`model`, `pretrain` "
        "then unused). Without `lora` its full weights go through Ray's object store: fine for small models")
    trust_remote_code: bool = Field(False, description="run the model repo's own modelling code (LLaDA needs it)")
    eos_token_id: int | None = Field(None, ge=0, description="`pretrained`: the token that ends a completion, when "
                                     "the tokenizer declares none (or another is wanted); positions after the first "
                                     "one are left out of the likelihood (sampler.score_after_eos)")
    pad_token_id: int | None = Field(None, ge=0, description="`pretrained`: the token prompts are left-padded with "
                                     "(default: the tokenizer's pad token, else its EOS, as d1 and SPG do)")
    lora: LoRAConfig | None = Field(None, description="train LoRA adapters only (d1 and its successors train an 8B "
                                    "dLLM this way): the optimiser, weight sync and checkpoints carry the adapters; "
                                    "target_modules default per model type (rollout/masked_lm.py). None: every weight")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="the base model's weights; bfloat16 (with lora, whose adapters stay float32) halves "
        "their memory")
    partial_credit: bool = Field(False, description="sudoku: reward the share of valid rows/columns/boxes")
    prompts_per_step: int = Field(16, ge=1, description="fresh problems per RL step (split over rollout workers)")
    train_seed: int = Field(202, description="seed of the RL problems (pre-training and eval use others)")
    eval_seed: int = Field(303, description="seed of the fixed held-out evaluation problems")
    eval_problems: int = Field(200, ge=1, description="held-out problems per evaluation (greedy decoding)")
    functions: list[UserRewardSpec] = Field(
        default_factory=list, description="your own rewards beside the verifier: functions (kind python, "
        "reward/python_reward.py: called with the completions, their prompts and reference answers as text), "
        "remote scorers (kind http, reward/http_reward.py) or an installed plug-in package's reward kinds")
    train_on: str = Field("verifier", description="what trains: 'verifier', a function's name, 'mean' of them all, "
                          "or 'weighted' (`weighting`); the exact-match verdict always watches")
    weighting: RewardWeighting | None = Field(None, description="train_on 'weighted': the verifier's and functions' "
                                              "weights and normalisation (reward/weighting.py)")

    sampler_kinds: ClassVar[tuple[str, ...]] = ("masked_diffusion",)
    no_reward_backprop: ClassVar[str | None] = ("its reward is an exact verifier of decoded text, which has no "
                                                "gradient: use a policy-gradient objective (grpo, stabledrl, bgpo)")

    def max_workers(self) -> int:
        """One problem per worker at most."""
        return self.prompts_per_step

    @model_validator(mode="after")
    def _file_task(self) -> "ArithSettings":
        if self.task == "file" and self.file is None:
            raise ValueError("testbed.task=file needs testbed.file.task_file (a .jsonl / .parquet file or a shipped "
                             "name)")
        if self.task != "file" and self.file is not None:
            raise ValueError(f"testbed.file is set but testbed.task={self.task!r}: set testbed.task=file")
        if self.file is not None:
            self.file.rows()  # a missing file, or a row without its fields, fails here naming the line and field
        return self

    @field_validator("functions")
    @classmethod
    def _named_scores(cls, v: list[UserRewardSpec]) -> list[UserRewardSpec]:
        return named_score_columns(v)  # a function's `keys`: one column each

    @model_validator(mode="after")
    def _rewards(self) -> "ArithSettings":
        names = ["verifier", *[f.name for f in self.functions]]
        clash = sorted({n for n in names if names.count(n) > 1} | ({"exact"} & set(names)))
        if clash:
            raise ValueError(f"testbed.functions: names must be unique and not 'verifier' or 'exact', got {clash}")
        check_weighting(self.train_on, self.weighting, names, ["exact"])
        if self.weighting is None and self.train_on != "mean" and self.train_on not in names:
            raise ValueError(f"testbed.train_on={self.train_on!r} must be 'mean', 'weighted' or one of {names}")
        return self

    @model_validator(mode="after")
    def _bf16_needs_lora(self) -> "ArithSettings":
        if self.dtype == "bfloat16" and self.lora is None:
            raise ValueError("testbed.dtype=bfloat16 needs testbed.lora (float32 adapters under a bf16 base); training "
                             "every weight in bf16 is not supported")
        return self

    @model_validator(mode="after")
    def _token_ids_need_a_tokenizer(self) -> "ArithSettings":
        named = [k for k in ("eos_token_id", "pad_token_id") if getattr(self, k) is not None]
        if named and self.pretrained is None:
            raise ValueError(f"testbed.{named[0]} applies to a pretrained model's tokenizer (testbed.pretrained); the "
                             "arith character tokenizer has fixed ids (<pad>=0, <eos>=2)")
        return self

    def check(self, cfg: "TrainConfig") -> None:
        if self.pretrained is None and self.model.max_positions < cfg.sampler.gen_length + 20:
            raise ValueError(f"testbed.model.max_positions={self.model.max_positions} is shorter than the longest "
                             f"prompt + sampler.gen_length ({cfg.sampler.gen_length})")


class MaskedLM(ModelFamily):
    """A bidirectional masked LM (transformers' masked LMs, LLaDA) sampled by masked diffusion."""

    cache_tag = "mlm"
    weights_file = "masked_lm.safetensors"
    export_tags = ("diffusion-lm", "masked-diffusion")

    def mask_token_id(self, tb: ArithTaskTestbed) -> int:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.masked_lm import resolve_pretrained_masked_lm

        a = tb.settings
        return TOKENIZER.mask_token_id if a.pretrained is None else resolve_pretrained_masked_lm(
            a.pretrained, a.trust_remote_code)[2]

    def lora_targets(self, net: nn.Module, named: list[str] | None) -> list[str]:
        from steadyrl.rollout.masked_lm import lora_targets

        return named or lora_targets(net)

    def load_pretrained(self, tb: ArithTaskTestbed, dtype=None) -> nn.Module:
        from steadyrl.rollout.masked_lm import load_pretrained_masked_lm

        a = tb.settings
        return load_pretrained_masked_lm(a.pretrained, a.trust_remote_code, dtype)[0]

    def tiny_network(self, tb: ArithTaskTestbed, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.masked_lm import masked_lm_from_weights

        return masked_lm_from_weights(tb.settings.model, len(TOKENIZER), weights)

    def pretrained_architecture(self, tb: ArithTaskTestbed, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.masked_lm import pretrained_architecture_with_weights

        a = tb.settings
        return pretrained_architecture_with_weights(a.pretrained, weights, a.trust_remote_code)

    def pretrain_tiny(self, tb: ArithTaskTestbed, progress: bool) -> Path:
        from steadyrl.services.testbeds.arith.pretrain_masked_lm import ensure_pretrained_masked_lm

        a = tb.settings
        return ensure_pretrained_masked_lm(tb.task, a.model, a.pretrain, progress)

    def sampler_options(self, tb: ArithTaskTestbed) -> dict[str, Any]:
        return {"mask_token_id": tb.mask_token_id}

    def auto_class(self, tb: ArithTaskTestbed) -> str:
        """AutoModelForMaskedLM, or the Auto class a named model loads with (LLaDA's remote code: its auto_map's)."""
        from steadyrl.rollout.masked_lm import resolve_pretrained_masked_lm

        a = tb.settings
        return ("AutoModelForMaskedLM" if a.pretrained is None else
                resolve_pretrained_masked_lm(a.pretrained, a.trust_remote_code)[1].__name__)

    def export_generation(self, tb: ArithTaskTestbed) -> dict[str, Any]:
        """The masked-diffusion sampler's settings under LLaDA's `generate` names (steps, gen_length, block_length,
        temperature (left out at 0: greedy), cfg_scale, remasking), with the mask, EOS and pad ids."""
        s = tb.cfg.sampler
        return {"mask_token_id": tb.mask_token_id, "eos_token_id": tb.codec.eos_id, "pad_token_id": tb.codec.pad_id,
                "max_new_tokens": s.gen_length, "gen_length": s.gen_length, "steps": s.num_steps,
                "block_length": s.block_length or s.gen_length, "do_sample": s.temperature > 0,
                **({"temperature": s.temperature} if s.temperature > 0 else {}), "cfg_scale": s.cfg_scale,
                "remasking": s.remasking}


class ArithTestbed(ArithTaskTestbed):
    """A tiny masked-diffusion LM on synthetic problems; the exact verifier is reward and monitor."""

    name = "arith"
    Settings = ArithSettings
    rest = RestProfile("arith", ArithRequest, items=True, legacy_route="/score_text", legacy_request=TextScoreRequest)
    family = MaskedLM()
