"""The arith testbed: a masked-diffusion LM on synthetic problems, an exact verifier."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from torch import Tensor, nn

from steadyrl.reward.ensemble import EnsembleScores, RewardEnsemble
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.samplers import build_sampler
from steadyrl.services.testbeds.base import Testbed


class ArithTestbed(Testbed):
    """A tiny masked-diffusion LM on synthetic problems; the exact verifier is reward and monitor."""

    name = "arith"
    labels = ("verifier", "exact")

    @property
    def task(self):
        from steadyrl.rollout.arith import ArithTask

        a = self.cfg.arith
        return ArithTask(task=a.task, digits=a.digits, blanks=a.blanks, gen_length=self.cfg.sampler.gen_length)

    @cached_property
    def mask_token_id(self) -> int:
        from steadyrl.rollout.arith import TOKENIZER
        from steadyrl.rollout.masked_lm import resolve_pretrained_masked_lm

        a = self.cfg.arith
        return TOKENIZER.mask_token_id if a.pretrained is None else resolve_pretrained_masked_lm(
            a.pretrained, a.trust_remote_code)[2]

    @cached_property
    def codec(self):
        """The character tokenizer, or the real model's (`arith.pretrained`)."""
        from steadyrl.rollout.text_codec import load_codec

        a = self.cfg.arith
        return load_codec(a.pretrained, a.trust_remote_code, None if a.pretrained is None else self.mask_token_id)

    def base_weights(self, progress: bool = True) -> Path:
        """The tiny BERT pre-trained here, or the named model's weights (copied once into the cache as
        safetensors, so every actor gets them through the object store the same way)."""
        a = self.cfg.arith
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

        a = self.cfg.arith
        if a.pretrained is not None:
            return pretrained_architecture_with_weights(a.pretrained, weights, a.trust_remote_code)
        return masked_lm_from_weights(a.model, len(TOKENIZER), weights)

    def build_sampler(self):
        return build_sampler(self.cfg.sampler, mask_token_id=self.mask_token_id)

    def eval_sampler(self):
        """Greedy decoding (temperature 0): exact match of the policy's most likely answer."""
        cfg = self.cfg.sampler.model_copy(update={"temperature": 0.0})
        return build_sampler(cfg, mask_token_id=self.mask_token_id)

    @property
    def eval_per_prompt(self) -> int:
        """One greedy completion per held-out problem (within-group diversity is then 0 by definition)."""
        return 1

    @property
    def max_workers(self) -> int:
        return self.cfg.arith.prompts_per_step

    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        """Fresh problems every step: problem ids step * prompts_per_step + k of the run's training seed."""
        per_step = self.cfg.arith.prompts_per_step
        share = np.array_split(np.arange(per_step), n_workers)[worker]
        ids = (step * per_step + share).tolist()
        problems = self.task.problems(self.cfg.arith.train_seed, ids)
        return self.task.encode_prompts(problems, self.codec), int(share[0])

    def eval_prompts(self) -> Tensor:
        return self.task.encode_prompts(self.task.problems(self.cfg.arith.eval_seed,
                                                           range(self.cfg.arith.eval_problems)), self.codec)

    def prepare_rewards(self, console=None) -> None:
        """A verifier needs nothing built."""

    def reward_spec(self) -> Any:
        from steadyrl.reward.verifiers import VerifierSpec

        a = self.cfg.arith
        return VerifierSpec(task=a.task, partial_credit=a.partial_credit, tokenizer=a.pretrained,
                            trust_remote_code=a.trust_remote_code)

    def reward_ensemble(self) -> RewardEnsemble:
        from steadyrl.reward.factory import build_reward_model

        spec = self.reward_spec()
        member = build_reward_model(spec)
        exact = build_reward_model(spec.model_copy(update={"partial_credit": False, "name": "exact"}))
        return RewardEnsemble([member], spec.name, [exact], member)

    @property
    def gold_name(self) -> str:
        return "exact"

    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        from steadyrl.reward.diversity import nearest_neighbour_distance

        correct = scores.monitors["exact_correct"]
        codec = self.codec
        prompts = [codec.decode(p[p != codec.pad_id]) for p in batch.cond]
        completions = [codec.decode(c) for c in batch.samples]
        problems = self.task.problems(self.cfg.arith.eval_seed, range(self.cfg.arith.eval_problems))
        per = max(1, len(batch) // len(problems))  # eval batches are prompt-major: row i is problem i // per
        by_len: dict[str, list[float]] = {}
        for i, ok in enumerate(correct.tolist()):  # by the true answer's length (sums with a carry out: +1)
            by_len.setdefault(f"{len(problems[i // per].answer)}-digit answers", []).append(ok)
        return {
            "gold_accuracy": float(correct.mean()),
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
