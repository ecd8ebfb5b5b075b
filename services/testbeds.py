"""Testbeds: what the services read instead of constants (DESIGN §7).

A testbed joins its data half (rollout/: prompts, policy, sampler, pre-training) and its scoring half
(reward/: reward models, gold monitor or verifier, eval summary) by name. The rollout workers, the
learner, the controller, `steadyrl eval` and the reward app all go through this object, so a new
testbed is a new class here, not a fork of the loop.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from reward.ensemble import EnsembleScores, RewardEnsemble
from rollout.batch import RolloutBatch
from rollout.samplers import build_sampler
from services.config import TrainConfig


class Testbed(ABC):
    """One testbed of a run's config. Prompts are integer tensors: class ids [C] or prompt tokens [C, P]."""

    name: str
    #: (label of the training reward, label of the held-out accuracy) in progress bars and tables
    labels: tuple[str, str] = ("proxy", "gold")

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg

    # ------------------------------------------------------------------ data half
    @abstractmethod
    def base_weights(self, progress: bool = True) -> Path:
        """The pre-trained policy's weights (built and cached on first use)."""

    @abstractmethod
    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        """The policy network holding `weights`, in eval mode."""

    @abstractmethod
    def build_sampler(self):
        """The sampler of `cfg.sampler`, ready for this testbed's policy."""

    @property
    @abstractmethod
    def max_workers(self) -> int:
        """Rollout workers this testbed can split its prompts over."""

    @abstractmethod
    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        """(prompts of `worker` at `step`, its first group id; group ids never collide across workers)."""

    @abstractmethod
    def eval_prompts(self) -> Tensor:
        """The fixed held-out prompts of every evaluation."""

    def eval_sampler(self):
        """The sampler evaluations use (the training sampler unless the testbed says otherwise)."""
        return self.build_sampler()

    @property
    def eval_per_prompt(self) -> int:
        """Samples per evaluation prompt."""
        return self.cfg.run.eval_samples_per_class

    # ------------------------------------------------------------------ scoring half
    @abstractmethod
    def prepare_rewards(self, console=None) -> None:
        """Build/check the reward models before Serve loads them (and print what was built)."""

    @abstractmethod
    def reward_ensemble(self) -> RewardEnsemble:
        """The same reward models in-process (evaluation without Ray, benchmarks)."""

    @abstractmethod
    def reward_spec(self) -> Any:
        """What `services.reward_app.build_reward_app` deploys (the testbed's reward models)."""

    @property
    @abstractmethod
    def gold_name(self) -> str:
        """The held-out monitor (never trained on) whose `<name>_correct` is the headline accuracy."""

    def rollout_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, float]:
        """Scalars of one rollout batch (sample-weighted across workers by the controller)."""
        from reward.diversity import nearest_neighbour_distance

        gold = self.gold_name
        out = {
            "reward/train_mean": float(scores.reward.mean()),
            "reward/ensemble_mean": float(scores.mean.mean()),
            "reward/ensemble_std": float(scores.std.mean()),
            "reward/uncertainty_mean": float(scores.uncertainty.mean()),
            "reward/gold_mean": float(scores.monitors[gold].mean()),
            "reward/gold_accuracy": float(scores.monitors[f"{gold}_correct"].mean()),
            "diversity/nn_distance": float(nearest_neighbour_distance(scores.features, batch.group).mean()),
        }
        for name, col in zip(scores.names, scores.scores.T):
            out[f"reward/{name}"] = float(col.mean())
        return out

    @abstractmethod
    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        """`gold_accuracy`, `proxy_mean`, `diversity_nn`, `breakdown` {label: accuracy} and `n_samples`,
        plus whatever `save_eval` draws (removed before the result is written as JSON)."""

    @abstractmethod
    def save_eval(self, result: dict[str, Any], path_stem: Path, title: str) -> None:
        """Write the evaluation's picture or examples next to `path_stem` (and pop what it used)."""


# ======================================================================================== digits
class DigitsTestbed(Testbed):
    """Class-conditional 8x8 digits: classifier ensemble rewards, a gold classifier as the monitor."""

    name = "digits"

    def base_weights(self, progress: bool = True) -> Path:
        from trainer.pretrain import ensure_pretrained_unet

        cfg = self.cfg
        return ensure_pretrained_unet(cfg.model, cfg.scheduler, cfg.pretrain, progress=progress,
                                      prediction=cfg.sampler.prediction)

    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        from rollout.models import unet_from_weights

        return unet_from_weights(self.cfg.model, weights)

    def build_sampler(self):
        return build_sampler(self.cfg.sampler, self.cfg.scheduler)

    @property
    def max_workers(self) -> int:
        from rollout.digits import NUM_CLASSES

        return NUM_CLASSES

    def _classes(self, worker: int, n_workers: int) -> np.ndarray:
        from rollout.digits import NUM_CLASSES

        return np.array_split(np.arange(NUM_CLASSES), n_workers)[worker]

    def train_prompts(self, worker: int, n_workers: int, step: int) -> tuple[Tensor, int]:
        classes = self._classes(worker, n_workers)
        return torch.as_tensor(classes, dtype=torch.long), int(classes[0])

    def eval_prompts(self) -> Tensor:
        from rollout.digits import NUM_CLASSES

        return torch.arange(NUM_CLASSES)

    def prepare_rewards(self, console=None) -> None:
        from reward.config import build_reward_models, print_accuracies

        members, monitors, _ = build_reward_models(self.cfg.reward)
        if console is not None:
            print_accuracies(members, monitors, console)

    def reward_ensemble(self) -> RewardEnsemble:
        from reward.config import build_reward_models

        members, monitors, feature = build_reward_models(self.cfg.reward)
        return RewardEnsemble(members, self.cfg.reward.train_on, monitors, next(m for m in members if m.name == feature))

    def reward_spec(self) -> Any:
        return self.cfg.reward

    @property
    def gold_name(self) -> str:
        return self.cfg.reward.gold.name

    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        from reward.evaluation import class_grid, eval_summary
        from rollout.digits import NUM_CLASSES

        result = eval_summary(batch.cond, batch.group, scores, self.gold_name, NUM_CLASSES)
        result["breakdown"] = {str(c): a for c, a in enumerate(result["gold_accuracy_per_class"])}
        result["grid"] = class_grid(batch.samples, NUM_CLASSES, 8)
        return result

    def save_eval(self, result: dict[str, Any], path_stem: Path, title: str) -> None:
        from services.report import save_sample_grid

        save_sample_grid(result.pop("grid"), path_stem.with_suffix(".png"), title, result["gold_accuracy_per_class"])


# ========================================================================================= arith
class ArithTestbed(Testbed):
    """A tiny masked-diffusion LM on synthetic problems; the exact verifier is reward and monitor."""

    name = "arith"
    labels = ("verifier", "exact")

    @property
    def task(self):
        from rollout.arith import ArithTask

        a = self.cfg.arith
        return ArithTask(task=a.task, digits=a.digits, blanks=a.blanks, gen_length=self.cfg.sampler.gen_length)

    @cached_property
    def mask_token_id(self) -> int:
        from rollout.arith import TOKENIZER
        from rollout.masked_lm import resolve_pretrained_masked_lm

        a = self.cfg.arith
        return TOKENIZER.mask_token_id if a.pretrained is None else resolve_pretrained_masked_lm(
            a.pretrained, a.trust_remote_code)[2]

    @cached_property
    def codec(self):
        """The character tokenizer, or the real model's (`arith.pretrained`)."""
        from rollout.text_codec import load_codec

        a = self.cfg.arith
        return load_codec(a.pretrained, a.trust_remote_code, None if a.pretrained is None else self.mask_token_id)

    def base_weights(self, progress: bool = True) -> Path:
        """The tiny BERT pre-trained here, or the named model's weights (copied once into the cache as
        safetensors, so every actor gets them through the object store the same way)."""
        a = self.cfg.arith
        if a.pretrained is not None and (Path(a.pretrained) / "model.safetensors").exists():
            return Path(a.pretrained) / "model.safetensors"  # a local directory written by save_pretrained
        if a.pretrained is not None:
            from rollout.cache import build_dir_atomically, cache_root, config_key
            from rollout.masked_lm import load_pretrained_masked_lm
            from rollout.models import save_weights

            def build(tmp: Path) -> None:
                save_weights(load_pretrained_masked_lm(a.pretrained, a.trust_remote_code)[0], tmp / "masked_lm.safetensors")

            key = config_key({"pretrained": a.pretrained})
            return build_dir_atomically(cache_root() / "models" / f"pretrained-mlm-{key}", build) / "masked_lm.safetensors"
        from trainer.pretrain_masked_lm import ensure_pretrained_masked_lm

        return ensure_pretrained_masked_lm(self.task, a.model, a.pretrain, progress)

    def build_policy(self, weights: dict[str, Tensor]) -> nn.Module:
        from rollout.arith import TOKENIZER
        from rollout.masked_lm import masked_lm_from_weights, pretrained_architecture_with_weights

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
        from reward.verifiers import VerifierSpec

        a = self.cfg.arith
        return VerifierSpec(task=a.task, partial_credit=a.partial_credit, tokenizer=a.pretrained,
                            trust_remote_code=a.trust_remote_code)

    def reward_ensemble(self) -> RewardEnsemble:
        from reward.verifiers import VerifierReward

        spec = self.reward_spec()
        member = VerifierReward.from_spec(spec)
        exact = VerifierReward.from_spec(spec.model_copy(update={"partial_credit": False, "name": "exact"}))
        return RewardEnsemble([member], spec.name, [exact], member)

    @property
    def gold_name(self) -> str:
        return "exact"

    def eval_summary(self, batch: RolloutBatch, scores: EnsembleScores) -> dict[str, Any]:
        from reward.diversity import nearest_neighbour_distance

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


TESTBEDS: dict[str, type[Testbed]] = {"digits": DigitsTestbed, "arith": ArithTestbed}


def build_testbed(cfg: TrainConfig) -> Testbed:
    return TESTBEDS[cfg.testbed](cfg)
