"""What a rollout worker does, without Ray: sample a step's groups with a policy copy, score them, summarise.

The Ray actor (`services.runtime.actors.RolloutWorker`) and the local runtime (`services.runtime.local_runtime`) both run this class,
so the two runtimes sample, score and summarise with the same code; they differ only in how weights arrive
and which scorer they pass in (the Serve ensemble's handle, or the in-process ensemble).
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
from torch import Tensor

from steadyrl.reward.ensemble import EnsembleScores, attach_scores
from steadyrl.rollout.batch import POLICY_VERSION, RolloutBatch
from steadyrl.rollout.compile import compile_network, compile_seconds
from steadyrl.rollout.policy import load_trainable_state
from steadyrl.services.config import TrainConfig
from steadyrl.services.testbeds import build_testbed

#: scores (samples, cond, group) -> EnsembleScores: the Serve ensemble's handle, or the in-process ensemble
Scorer = Callable[[Any, Any, Tensor | None], EnsembleScores]


def step_seed(seed: int, step: int, worker: int) -> int:
    """Per-step, per-worker sampling seed: resuming at step k replays exactly the same noise."""
    return (seed * 1_000_003 + step * 1009 + worker) % (2**63 - 1)


class Rollouts:
    """A policy copy on `device` and the testbed's samplers; generates worker `index`'s share of each step."""

    def __init__(self, cfg: TrainConfig, base_weights: dict[str, Tensor], device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.testbed = build_testbed(cfg)
        self.policy = self.testbed.build_rollout_policy(base_weights, device)
        if cfg.compile.rollout:
            compile_network(self.policy, cfg.compile)
        self.sampler = self.testbed.build_sampler()
        self.version = 0  # learner updates behind the weights held (0: the base weights)

    def load(self, version: int, weights: dict[str, Tensor]) -> float:
        """Hold policy `version` (the learner's trained tensors: whole network or LoRA adapters); seconds taken."""
        t0 = time.perf_counter()
        load_trainable_state(self.policy, weights)
        self.version = version
        return time.perf_counter() - t0

    def generate(self, step: int, index: int, n_workers: int, score: Scorer) -> tuple[RolloutBatch, dict[str, float]]:
        """(scored batch for the learner, small summary for the controller) of worker `index` at `step`; the
        sampling seed depends only on (run seed, step, index), so a re-issued call redraws the same samples."""
        gen = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, step, index))
        prompts, group_offset = self.testbed.train_prompts(index, n_workers, step)
        t0, compiled_s = time.perf_counter(), compile_seconds()
        # an SDE window (MixGRPO, Flow-GRPO-Fast) sits where (config, step, run seed) put it, on every worker
        window = {"train_step": step, "window_seed": self.cfg.run.seed} if getattr(self.sampler, "windowed", False) \
            else {}
        batch = self.testbed.sample(self.sampler, self.policy, prompts, self.cfg.sampler.group_size, gen,
                                    group_offset=group_offset, **window)
        t1 = time.perf_counter()
        batch, scores = self.score(batch, score)
        batch = batch.with_extras(**{POLICY_VERSION: torch.full((len(batch),), self.version, dtype=torch.long)})
        summary = self.testbed.rollout_summary(batch, scores)
        summary.update({"timing_s/rollout": t1 - t0, "timing_s/reward": time.perf_counter() - t1,
                        "n": float(len(batch))})
        if self.cfg.compile.rollout:
            summary["timing_s/rollout_compile"] = compile_seconds() - compiled_s  # within timing_s/rollout
        return batch, summary

    def score(self, batch: RolloutBatch, score: Scorer) -> tuple[RolloutBatch, EnsembleScores]:
        """The batch with its rewards attached, and the ensemble's scores."""
        samples, cond = self.testbed.reward_inputs(self.policy, batch)
        scores = score(samples, cond, batch.group)
        return attach_scores(batch, scores), scores

    def evaluate(self, seed: int, score: Scorer) -> dict[str, Any]:
        """The testbed's held-out evaluation on seeded samples (accuracy, reward, diversity, a picture)."""
        gen, compiled_s = torch.Generator().manual_seed(seed), compile_seconds()
        batch = self.testbed.sample(self.testbed.eval_sampler(), self.policy, self.testbed.eval_prompts(),
                                    self.testbed.eval_per_prompt, gen)
        batch, scores = self.score(batch, score)
        summary = self.testbed.eval_summary(batch, scores)
        if self.cfg.compile.rollout:  # the evaluation's batch shape compiles once too
            summary["rollout_compile_s"] = compile_seconds() - compiled_s
        return summary
