"""The arith task for any model family: synthetic problems or a task file, prompts, the exact verifier as reward
and monitor, evaluation, and the policy (full weights or LoRA over a cached base). The family (`family.py`) supplies
the model; masked.py, autoregressive.py and block_diffusion.py register the task with theirs."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from torch import Tensor, nn

from steadyrl.reward.ensemble import EnsembleScores, finite_mean
from steadyrl.reward.ensemble_spec import EnsembleSpec
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.sampler_factory import build_sampler
from steadyrl.services.testbeds.arith.family import ModelFamily
from steadyrl.services.testbeds.base import Testbed

if TYPE_CHECKING:
    from steadyrl.services.testbeds.arith.masked import ArithSettings


class ArithTaskTestbed(Testbed):
    """A language model of `family` on the arith tasks; the exact verifier is reward and monitor."""

    family: ClassVar[ModelFamily]
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

    @property
    def uses_vllm(self) -> bool:
        """sampler.backend=vllm: rollout workers sample with the family's inference engine."""
        return getattr(self.cfg.sampler, "backend", None) == "vllm"

    def preflight(self) -> None:
        """The sampler, a file task's prompts (each within max_prompt_length and the tiny model's positions), and
        with sampler.backend=vllm the engine (installed, serving the model's architecture)."""
        super().preflight()
        a = self.settings
        if a.task == "file":
            width = self.file_task.width  # encodes every prompt: one too long is an error naming its row
            if a.pretrained is None and a.model.max_positions < width + self.cfg.sampler.gen_length:
                raise ValueError(f"testbed.model.max_positions={a.model.max_positions} is shorter than the longest "
                                 f"prompt of {a.file.task_file!r} ({width} tokens) + sampler.gen_length "
                                 f"({self.cfg.sampler.gen_length})")
        if self.uses_vllm:
            self.family.check_engine(self)

    @cached_property
    def mask_token_id(self) -> int | None:
        """The tokenizer's mask token, for a family that masks (a masked-diffusion LM); else None."""
        return self.family.mask_token_id(self)

    @cached_property
    def codec(self):
        """The character tokenizer, or the real model's (`pretrained`), with the family's mask token if any."""
        from steadyrl.rollout.text_codec import load_codec

        a = self.settings
        return load_codec(a.pretrained, a.trust_remote_code, None if a.pretrained is None else self.mask_token_id,
                          a.eos_token_id, a.pad_token_id)

    @cached_property
    def hf_config(self):
        """The model's transformers config, without its weights (families with an inference engine)."""
        return self.family.hf_config(self)

    # ------------------------------------------------------------------ the policy
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
        return (build_dir_atomically(cache_root() / "models" / f"{self.family.cache_tag}-lora-{key}", build)
                / "trainable.safetensors")

    def _base_network(self) -> nn.Module:
        """The frozen base under LoRA, built in this process in `dtype`: the named model (hub cache or directory),
        or the tiny model pre-trained here."""
        import torch
        from safetensors.torch import load_file

        a, dtype = self.settings, getattr(torch, self.settings.dtype)
        if a.pretrained is not None:
            return self.family.load_pretrained(self, dtype)
        return self.family.tiny_network(self, load_file(str(self._full_weights(False)))).to(dtype)

    def _lora_policy(self) -> nn.Module:
        """The base with fresh LoRA adapters (float32 under a bf16 base): only they train (rollout/lora.py)."""
        from steadyrl.rollout.lora import add_lora
        from steadyrl.rollout.policy import LanguageModelPolicy

        policy = LanguageModelPolicy(self._base_network())
        lora = self.settings.lora
        return add_lora(policy, lora, self.family.lora_targets(policy.net, lora.target_modules))

    def _full_weights(self, progress: bool = True) -> Path:
        """The tiny model pre-trained here, or the named model's weights (copied once into the cache as
        safetensors, so every actor gets them through the object store the same way)."""
        a, family = self.settings, self.family
        if a.pretrained is not None and (Path(a.pretrained) / "model.safetensors").exists():
            return Path(a.pretrained) / "model.safetensors"  # a local directory written by save_pretrained
        if a.pretrained is not None:
            from steadyrl.rollout.cache import build_dir_atomically, cache_root, config_key
            from steadyrl.rollout.state_dict import save_weights

            def build(tmp: Path) -> None:
                save_weights(family.load_pretrained(self), tmp / family.weights_file)

            key = config_key({"pretrained": a.pretrained})
            return (build_dir_atomically(cache_root() / "models" / f"pretrained-{family.cache_tag}-{key}", build)
                    / family.weights_file)
        return family.pretrain_tiny(self, progress)

    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        a = self.settings
        if a.lora is not None:
            policy = self._lora_policy()
            policy.load_trainable_state_dict(weights)
            return policy.eval()
        if a.pretrained is not None:
            return self.family.pretrained_architecture(self, weights)
        return self.family.tiny_network(self, weights)

    def build_rollout_policy(self, weights: dict[str, Tensor], device) -> nn.Module:
        """transformers: the policy on `device`; vllm: the family's engine holding the base model and `weights`
        (the full weights, or the adapters)."""
        if not self.uses_vllm:
            return super().build_rollout_policy(weights, device)
        import tempfile

        from steadyrl.rollout.causal_lm import write_hf_checkpoint

        a = self.settings
        if a.pretrained is not None:  # the engine loads the named model itself
            model = a.pretrained
        else:  # the tiny base as a checkpoint directory the engine reads
            net = self._base_network() if a.lora is not None else self.family.tiny_network(self, weights)
            model = str(write_hf_checkpoint(net, Path(tempfile.mkdtemp(prefix="steadyrl-vllm-model-")),
                                            self.family.generation_config(self)))
        targets = None if a.lora is None else self.family.lora_targets(self.hf_config, a.lora.target_modules)
        return self.family.engine(self, model, weights, targets, device)

    def export(self, policy: nn.Module, out: Path, merge: bool = False):
        """A transformers model folder, or LoRA adapters in peft's format (arith/export.py)."""
        from steadyrl.services.testbeds.arith.export import export_language_model

        return export_language_model(self, policy, out, merge)

    def export_sources(self) -> list[tuple[str, str]]:
        """`pretrained`, when set: the policy's base (the tiny base is built here)."""
        a = self.settings
        return [] if a.pretrained is None else [("testbed.pretrained", a.pretrained)]

    def max_model_len(self) -> int:
        """The engine's context: the tiny model's positions, or the longest prompt + sampler.gen_length."""
        a = self.settings
        if a.pretrained is None:
            return a.model.max_positions
        return (self.file_task.width if a.task == "file" else a.max_prompt_length) + self.cfg.sampler.gen_length

    # ------------------------------------------------------------------ sampling and prompts
    def build_sampler(self):
        return self._sampler(self.cfg.sampler)

    def eval_sampler(self):
        """Greedy decoding (temperature 0) where the family asks for it: exact match of the most likely answer."""
        cfg = self.cfg.sampler
        return self._sampler(cfg.model_copy(update={"temperature": 0.0}) if self.family.greedy_eval else cfg)

    def _sampler(self, cfg):
        """The family's sampler with the tokenizer's EOS and pad ids (and what else the family needs)."""
        codec = self.codec
        return build_sampler(cfg, eos_token_id=codec.eos_id, pad_token_id=codec.pad_id,
                             **self.family.sampler_options(self))

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

    def prompts_from_text(self, texts: list[str]) -> Tensor:
        """Problems written as text ("07+45="; task=file: a question, put in the model's chat template as its rows
        are), encoded by the testbed's tokenizer and left-padded to one width."""
        import torch

        from steadyrl.rollout.task_file_dataset import chat_tokenizer
        from steadyrl.rollout.task_file_reader import render_prompt
        from steadyrl.services.testbeds.base import PromptError

        a, codec, gen = self.settings, self.codec, self.cfg.sampler.gen_length
        rows = []
        for text in texts:
            shown = (render_prompt(text, chat_tokenizer(codec), a.file.system_prompt) if a.task == "file" else text)
            try:
                ids = codec.encode(shown)
            except ValueError as err:
                raise PromptError(f"prompt {text!r} cannot be encoded: {err}") from None
            if not ids:
                raise PromptError(f"prompt {text!r} encodes to no tokens")
            if a.pretrained is None and len(ids) + gen > a.model.max_positions:
                raise PromptError(f"prompt {text!r} is {len(ids)} tokens: with sampler.gen_length={gen} it is longer "
                                  f"than the model's testbed.model.max_positions={a.model.max_positions}")
            rows.append(ids)
        width = max(map(len, rows))
        return torch.tensor([[codec.pad_id] * (width - len(r)) + r for r in rows], dtype=torch.long)

    # ------------------------------------------------------------------ rewards and evaluation
    def prepare_rewards(self, console=None) -> None:
        """A verifier needs nothing built."""

    def reward_model_sources(self) -> list[tuple[str, str]]:
        """`pretrained`, when set: the verifier decodes with its tokenizer (and the policy is that model)."""
        a = self.settings
        return [] if a.pretrained is None else [("testbed.pretrained", a.pretrained)]

    def reward_spec(self) -> EnsembleSpec:
        """The task's verifier (partial credit if asked) and the user's functions (decoding with the verifier's
        tokenizer) score; `train_on` trains; an exact-match verifier watches, and its 0/1 verdict is the held-out
        accuracy."""
        from steadyrl.reward.verifiers import VerifierSpec

        a = self.settings
        verifier = VerifierSpec(task=a.task, file=a.file, partial_credit=a.partial_credit, tokenizer=a.pretrained,
                                trust_remote_code=a.trust_remote_code, eos_token_id=a.eos_token_id,
                                pad_token_id=a.pad_token_id)
        exact = verifier.model_copy(update={"partial_credit": False, "name": "exact"})
        functions = [f.model_copy(update={"text": verifier}) if "text" in type(f).model_fields else f
                     for f in a.functions]  # a plug-in reward kind decodes with the verifier if it has `text`
        return EnsembleSpec(members=[verifier, *functions], monitors=[exact], train_on=a.train_on,
                            feature_model=verifier.name, correct=[exact.name], weighting=a.weighting)

    @property
    def gold_name(self) -> str:
        return "exact"

    def readable(self, policy: nn.Module | None, batch: RolloutBatch) -> tuple[list[str], list[str]]:
        """(the prompts, the completions) decoded as text."""
        codec = self.codec
        return [codec.decode(p[p != codec.pad_id]) for p in batch.cond], [codec.decode(c) for c in batch.samples]

    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        from steadyrl.reward.diversity import nearest_neighbour_distance

        correct = scores.monitors["exact_correct"]
        prompts, completions = self.readable(None, batch)
        by_len: dict[str, list[float]] = {}
        if self.settings.task != "file":  # by the true answer's length (sums with a carry out: +1)
            problems = self.task.problems(self.settings.eval_seed, range(self.settings.eval_problems))
            per = max(1, len(batch) // len(problems))  # eval batches are prompt-major: row i is problem i // per
            for i, ok in enumerate(correct.tolist()):
                by_len.setdefault(f"{len(problems[i // per].answer)}-digit answers", []).append(ok)
        return {
            "held_out": float(correct.mean()),
            "proxy_mean": finite_mean(scores.reward),
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
