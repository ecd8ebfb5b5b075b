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
from steadyrl.rollout.masked_lm import MaskedLMConfig
from steadyrl.rollout.samplers import build_sampler
from steadyrl.services.serving.schemas import ArithRequest, RestProfile, TextScoreRequest
from steadyrl.services.testbeds.base import Testbed
from steadyrl.services.testbeds.settings import TestbedSettings
from steadyrl.trainer.pretrain_masked_lm import MaskedLMPretrainConfig

if TYPE_CHECKING:
    from steadyrl.services.config import TrainConfig


class ArithSettings(TestbedSettings):
    """The arith testbed: synthetic problems, a tiny masked-diffusion LM (or a real one by name), an exact
    verifier."""

    name: Literal["arith"] = "arith"
    task: Literal["addition", "sudoku"] = "addition"
    digits: int = Field(2, ge=1, le=8, description="addition: operand digits (zero-padded in the prompt)")
    blanks: int = Field(6, ge=1, le=16, description="sudoku: hidden cells of the 4x4 grid")
    model: MaskedLMConfig = Field(default_factory=MaskedLMConfig)
    pretrain: MaskedLMPretrainConfig = Field(default_factory=MaskedLMPretrainConfig)
    pretrained: str | None = Field(
        None, description="a real masked-diffusion LM by hub id or local directory (LLaDA, or any masked LM "
        "transformers implements) with its own tokenizer, instead of the tiny BERT built here (`model`, `pretrain` "
        "then unused). Its full weights go through Ray's object store: fine for small models; LoRA comes later")
    trust_remote_code: bool = Field(False, description="run the model repo's own modelling code (LLaDA needs it)")
    eos_token_id: int | None = Field(None, ge=0, description="`pretrained`: the token that ends a completion, when "
                                     "the tokenizer declares none (or another is wanted); positions after the first "
                                     "one are left out of the likelihood (sampler.score_after_eos)")
    pad_token_id: int | None = Field(None, ge=0, description="`pretrained`: the token prompts are left-padded with "
                                     "(default: the tokenizer's pad token, else its EOS, as d1 and SPG do)")
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
        from steadyrl.rollout.arith import ArithTask

        a = self.settings
        return ArithTask(task=a.task, digits=a.digits, blanks=a.blanks, gen_length=self.cfg.sampler.gen_length)

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
        """The tiny BERT pre-trained here, or the named model's weights (copied once into the cache as
        safetensors, so every actor gets them through the object store the same way)."""
        a = self.settings
        if a.pretrained is not None and (Path(a.pretrained) / "model.safetensors").exists():
            return Path(a.pretrained) / "model.safetensors"  # a local directory written by save_pretrained
        if a.pretrained is not None:
            from steadyrl.rollout.cache import build_dir_atomically, cache_root, config_key
            from steadyrl.rollout.masked_lm import load_pretrained_masked_lm
            from steadyrl.rollout.models import save_weights

            def build(tmp: Path) -> None:
                save_weights(load_pretrained_masked_lm(a.pretrained, a.trust_remote_code)[0], tmp / "masked_lm.safetensors")

            key = config_key({"pretrained": a.pretrained})
            return build_dir_atomically(cache_root() / "models" / f"pretrained-mlm-{key}", build) / "masked_lm.safetensors"
        from steadyrl.trainer.pretrain_masked_lm import ensure_pretrained_masked_lm

        return ensure_pretrained_masked_lm(self.task, a.model, a.pretrain, progress)

    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.masked_lm import (
            masked_lm_from_weights,
            pretrained_architecture_with_weights,
        )

        a = self.settings
        if a.pretrained is not None:
            return pretrained_architecture_with_weights(a.pretrained, weights, a.trust_remote_code)
        return masked_lm_from_weights(a.model, len(TOKENIZER), weights)

    def build_sampler(self):
        return self._sampler(self.cfg.sampler)

    def eval_sampler(self):
        """Greedy decoding (temperature 0): exact match of the policy's most likely answer."""
        return self._sampler(self.cfg.sampler.model_copy(update={"temperature": 0.0}))

    def _sampler(self, cfg):
        """The masked-diffusion sampler with the tokenizer's mask, EOS and pad ids."""
        codec = self.codec
        return build_sampler(cfg, mask_token_id=self.mask_token_id, eos_token_id=codec.eos_id, pad_token_id=codec.pad_id)

    @property
    def eval_per_prompt(self) -> int:
        """One greedy completion per held-out problem (within-group diversity is then 0 by definition)."""
        return 1

    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        """Fresh problems every step: problem ids step * prompts_per_step + k of the run's training seed."""
        per_step = self.settings.prompts_per_step
        share = np.array_split(np.arange(per_step), n_workers)[worker]
        ids = (step * per_step + share).tolist()
        problems = self.task.problems(self.settings.train_seed, ids)
        return self.task.encode_prompts(problems, self.codec), int(share[0])

    def eval_prompts(self) -> Tensor:
        return self.task.encode_prompts(self.task.problems(self.settings.eval_seed,
                                                           range(self.settings.eval_problems)), self.codec)

    def prepare_rewards(self, console=None) -> None:
        """A verifier needs nothing built."""

    def reward_spec(self) -> EnsembleSpec:
        """The task's verifier (partial credit if asked) trains; an exact-match verifier watches, and its 0/1
        verdict is the held-out accuracy."""
        from steadyrl.reward.verifiers import VerifierSpec

        a = self.settings
        verifier = VerifierSpec(task=a.task, partial_credit=a.partial_credit, tokenizer=a.pretrained,
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
        problems = self.task.problems(self.settings.eval_seed, range(self.settings.eval_problems))
        per = max(1, len(batch) // len(problems))  # eval batches are prompt-major: row i is problem i // per
        by_len: dict[str, list[float]] = {}
        for i, ok in enumerate(correct.tolist()):  # by the true answer's length (sums with a carry out: +1)
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
