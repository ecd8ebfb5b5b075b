"""The arith testbed: a masked-diffusion LM on synthetic problems, an exact verifier."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
from pydantic import Field, model_validator
from torch import Tensor, nn

from steadyrl.reward.ensemble import EnsembleScores
from steadyrl.reward.ensemble_spec import EnsembleSpec
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.lora import LoRAConfig
from steadyrl.rollout.masked_lm import MaskedLMConfig
from steadyrl.rollout.sampler_factory import build_sampler
from steadyrl.rollout.task_file_dataset import FileTaskSettings
from steadyrl.services.testbeds.arith.pretrain_masked_lm import MaskedLMPretrainConfig
from steadyrl.services.testbeds.arith.rest import ArithRequest, TextScoreRequest
from steadyrl.services.testbeds.base import Testbed
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


class ArithTestbed(Testbed):
    """A tiny masked-diffusion LM on synthetic problems; the exact verifier is reward and monitor."""

    name = "arith"
    Settings = ArithSettings
    rest = RestProfile("arith", ArithRequest, items=True, legacy_route="/score_text", legacy_request=TextScoreRequest)
    labels = ("verifier", "exact")
    settings: ArithSettings

    @property
    def task(self):
        """The synthetic task (a file task's tiny base model is pre-trained on synthetic addition)."""
        from steadyrl.rollout.arith import ArithTask

        a = self.settings
        task = "addition" if a.task == "file" else a.task
        return ArithTask(task=task, digits=a.digits, blanks=a.blanks, gen_length=self.cfg.sampler.gen_length)

    @cached_property
    def file_task(self):
        """task=file: the rows, split and encoded (rollout/task_file_dataset.py)."""
        from steadyrl.rollout.task_file_dataset import FileTask

        a = self.settings
        return FileTask(a.file, self.codec, a.eval_problems, a.eval_seed, a.max_prompt_length)

    def preflight(self) -> None:
        """The sampler, and a file task's prompts (each within max_prompt_length and the tiny model's positions)."""
        super().preflight()
        if self.settings.task != "file":
            return
        width, a = self.file_task.width, self.settings
        if a.pretrained is None and a.model.max_positions < width + self.cfg.sampler.gen_length:
            raise ValueError(f"testbed.model.max_positions={a.model.max_positions} is shorter than the longest prompt "
                             f"of {a.file.task_file!r} ({width} tokens) + sampler.gen_length "
                             f"({self.cfg.sampler.gen_length})")

    @cached_property
    def mask_token_id(self) -> int:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.masked_lm import resolve_pretrained_masked_lm

        a = self.settings
        return TOKENIZER.mask_token_id if a.pretrained is None else resolve_pretrained_masked_lm(
            a.pretrained, a.trust_remote_code)[2]

    @cached_property
    def codec(self):
        """The character tokenizer, or the real model's (`arith.pretrained`)."""
        from steadyrl.rollout.text_codec import load_codec

        a = self.settings
        return load_codec(a.pretrained, a.trust_remote_code, None if a.pretrained is None else self.mask_token_id,
                          a.eos_token_id, a.pad_token_id)

    def base_weights(self, progress: bool = True) -> Path:
        """The policy's initial trained tensors, written once into the cache: the whole model (`_full_weights`),
        or with `lora` only the adapters (B = 0); each actor then builds the frozen base itself (`_base_network`)
        and only adapters travel through the object store."""
        a = self.settings
        if a.lora is None:
            return self._full_weights(progress)
        from safetensors.torch import save_file

        from steadyrl.rollout.cache import build_dir_atomically, cache_root, config_key

        # the base's identity in the cache key (the tiny base is built here first, with its progress bar)
        base = a.pretrained if a.pretrained is not None else str(self._full_weights(progress))

        def build(tmp: Path) -> None:
            state = self._lora_policy().trainable_state_dict()
            save_file({k: v.detach().contiguous() for k, v in state.items()}, str(tmp / "trainable.safetensors"))

        key = config_key({"base": base, "lora": a.lora.model_dump(), "dtype": a.dtype})
        return (build_dir_atomically(cache_root() / "models" / f"{self.cache_tag}-lora-{key}", build)
                / "trainable.safetensors")

    # model-family hooks (the arith_ar testbed overrides them for a causal LM)
    cache_tag = "mlm"  # names the cache folders of a named model's weights and of LoRA's initial adapters
    weights_file = "masked_lm.safetensors"

    def _wrap(self, net: nn.Module) -> nn.Module:
        from steadyrl.rollout.policy import LanguageModelPolicy

        return LanguageModelPolicy(net)

    def _default_lora_targets(self, net: nn.Module) -> list[str]:
        from steadyrl.rollout.masked_lm import lora_targets

        return lora_targets(net)

    def _load_pretrained(self, dtype=None) -> nn.Module:
        """The named model (`pretrained`) with its weights, from the hub cache or a directory."""
        from steadyrl.rollout.masked_lm import load_pretrained_masked_lm

        a = self.settings
        return load_pretrained_masked_lm(a.pretrained, a.trust_remote_code, dtype)[0]

    def _tiny_network(self, weights: dict[str, Tensor]) -> nn.Module:
        """The tiny model built here, holding `weights`."""
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.masked_lm import masked_lm_from_weights

        return masked_lm_from_weights(self.settings.model, len(TOKENIZER), weights)

    def _pretrained_architecture(self, weights: dict[str, Tensor]) -> nn.Module:
        """The named model's architecture (config only) holding `weights`."""
        from steadyrl.rollout.masked_lm import pretrained_architecture_with_weights

        a = self.settings
        return pretrained_architecture_with_weights(a.pretrained, weights, a.trust_remote_code)

    def _pretrain_tiny(self, progress: bool) -> Path:
        """The tiny model's pre-trained weights (cached; rebuilt bitwise where the cache is empty)."""
        from steadyrl.services.testbeds.arith.pretrain_masked_lm import ensure_pretrained_masked_lm

        a = self.settings
        return ensure_pretrained_masked_lm(self.task, a.model, a.pretrain, progress)

    def _base_network(self) -> nn.Module:
        """The frozen base under LoRA, built in this process in `dtype`: the named model (hub cache or directory),
        or the tiny model pre-trained here."""
        import torch
        from safetensors.torch import load_file

        a, dtype = self.settings, getattr(torch, self.settings.dtype)
        if a.pretrained is not None:
            return self._load_pretrained(dtype)
        return self._tiny_network(load_file(str(self._full_weights(False)))).to(dtype)

    def _lora_policy(self) -> nn.Module:
        """The base with fresh LoRA adapters (float32 under a bf16 base): only they train (rollout/lora.py)."""
        from steadyrl.rollout.lora import add_lora

        policy = self._wrap(self._base_network())
        lora = self.settings.lora
        return add_lora(policy, lora, lora.target_modules or self._default_lora_targets(policy.net))

    def _full_weights(self, progress: bool = True) -> Path:
        """The tiny model pre-trained here, or the named model's weights (copied once into the cache as
        safetensors, so every actor gets them through the object store the same way)."""
        a = self.settings
        if a.pretrained is not None and (Path(a.pretrained) / "model.safetensors").exists():
            return Path(a.pretrained) / "model.safetensors"  # a local directory written by save_pretrained
        if a.pretrained is not None:
            from steadyrl.rollout.cache import build_dir_atomically, cache_root, config_key
            from steadyrl.rollout.state_dict import save_weights

            def build(tmp: Path) -> None:
                save_weights(self._load_pretrained(), tmp / self.weights_file)

            key = config_key({"pretrained": a.pretrained})
            return (build_dir_atomically(cache_root() / "models" / f"pretrained-{self.cache_tag}-{key}", build)
                    / self.weights_file)
        return self._pretrain_tiny(progress)

    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        a = self.settings
        if a.lora is not None:
            policy = self._lora_policy()
            policy.load_trainable_state_dict(weights)
            return policy.eval()
        if a.pretrained is not None:
            return self._pretrained_architecture(weights)
        return self._tiny_network(weights)

    def build_sampler(self):
        return self._sampler(self.cfg.sampler)

    def eval_sampler(self):
        """Greedy decoding (temperature 0): exact match of the policy's most likely answer."""
        return self._sampler(self.cfg.sampler.model_copy(update={"temperature": 0.0}))

    def _sampler(self, cfg):
        """The masked-diffusion sampler with the tokenizer's mask, EOS and pad ids."""
        codec = self.codec
        return build_sampler(cfg, mask_token_id=self.mask_token_id, eos_token_id=codec.eos_id,
                             pad_token_id=codec.pad_id)

    @property
    def eval_per_prompt(self) -> int:
        """One greedy completion per held-out problem (within-group diversity is then 0 by definition)."""
        return 1

    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        """Fresh problems every step: problem ids step * prompts_per_step + k of the run's training seed."""
        per_step = self.settings.prompts_per_step
        share = np.array_split(np.arange(per_step), n_workers)[worker]
        ids = (step * per_step + share).tolist()
        if self.settings.task == "file":
            return self.file_task.train_prompts(self.settings.train_seed, ids), int(share[0])
        problems = self.task.problems(self.settings.train_seed, ids)
        return self.task.encode_prompts(problems, self.codec), int(share[0])

    def eval_prompts(self) -> Tensor:
        if self.settings.task == "file":
            return self.file_task.eval_prompts()
        return self.task.encode_prompts(self.task.problems(self.settings.eval_seed,
                                                           range(self.settings.eval_problems)), self.codec)

    def prepare_rewards(self, console=None) -> None:
        """A verifier needs nothing built."""

    def reward_model_sources(self) -> list[tuple[str, str]]:
        """`pretrained`, when set: the verifier decodes with its tokenizer (and the policy is that model; the
        arith_ar and arith_bd testbeds source theirs the same way)."""
        a = self.settings
        return [] if a.pretrained is None else [("testbed.pretrained", a.pretrained)]

    def reward_spec(self) -> EnsembleSpec:
        """The task's verifier (partial credit if asked) trains; an exact-match verifier watches, and its 0/1
        verdict is the held-out accuracy."""
        from steadyrl.reward.verifiers import VerifierSpec

        a = self.settings
        verifier = VerifierSpec(task=a.task, file=a.file, partial_credit=a.partial_credit, tokenizer=a.pretrained,
                                trust_remote_code=a.trust_remote_code, eos_token_id=a.eos_token_id,
                                pad_token_id=a.pad_token_id)
        exact = verifier.model_copy(update={"partial_credit": False, "name": "exact"})
        return EnsembleSpec(members=[verifier], monitors=[exact], train_on=verifier.name,
                            feature_model=verifier.name, correct=[exact.name])

    @property
    def gold_name(self) -> str:
        return "exact"

    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        from steadyrl.reward.diversity import nearest_neighbour_distance

        correct = scores.monitors["exact_correct"]
        codec = self.codec
        prompts = [codec.decode(p[p != codec.pad_id]) for p in batch.cond]
        completions = [codec.decode(c) for c in batch.samples]
        by_len: dict[str, list[float]] = {}
        if self.settings.task != "file":  # by the true answer's length (sums with a carry out: +1)
            problems = self.task.problems(self.settings.eval_seed, range(self.settings.eval_problems))
            per = max(1, len(batch) // len(problems))  # eval batches are prompt-major: row i is problem i // per
            for i, ok in enumerate(correct.tolist()):
                by_len.setdefault(f"{len(problems[i // per].answer)}-digit answers", []).append(ok)
        return {
            "held_out": float(correct.mean()),
            "proxy_mean": float(scores.reward.mean()),
            "diversity_nn": float(nearest_neighbour_distance(scores.features, batch.group).mean()),
            "breakdown": {k: sum(v) / len(v) for k, v in sorted(by_len.items())},
            "n_samples": len(batch),
            "examples": [{"prompt": p, "completion": c, "correct": bool(ok)}
                         for p, c, ok in list(zip(prompts, completions, correct.tolist()))[:24]],
        }

    def save_eval(self, result: dict[str, Any], path_stem: Path, title: str) -> None:
        lines = [title, ""] + [f"{'ok ' if e['correct'] else 'XX '} {e['prompt']}{e['completion']}"
                               for e in result["examples"]]
        path_stem.with_suffix(".txt").write_text("\n".join(lines) + "\n")
