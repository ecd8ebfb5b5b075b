"""Rollout workers: Ray actors that sample with a policy copy and score through the Serve reward ensemble
(the learner ranks are in `learner_group`)."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve

from steadyrl.reward.ensemble import attach_scores
from steadyrl.rollout.batch import POLICY_VERSION, RolloutBatch
from steadyrl.rollout.policy import load_trainable_state, trainable_state
from steadyrl.services.config import TrainConfig
from steadyrl.services.retry import with_retries
from steadyrl.services.reward_app import APP_NAME
from steadyrl.services.runtime import redirect_output
from steadyrl.services.testbeds import build_testbed
from steadyrl.trainer.weight_broadcast import WeightBroadcastGroup


def torch_threads(cfg: TrainConfig, cores: int | None = None) -> int:
    """ray.torch_threads, else every core of the node when the phases run one after another, and half of them
    under pipelining (learner.max_staleness > 0), where rollout and learner compute at the same time: two
    processes with a thread per core each oversubscribe the node (on 2 cores both ran 2-7x slower)."""
    if cfg.ray.torch_threads:
        return cfg.ray.torch_threads
    cores = cores or os.cpu_count() or 1
    return max(1, cores // 2) if cfg.learner.max_staleness > 0 else cores


def setup_process(cfg: TrainConfig, log_file: Path) -> None:
    redirect_output(log_file)
    torch.set_num_threads(torch_threads(cfg))


def actor_device(gpus: float) -> torch.device:
    """cuda when this actor was given a GPU (Ray sets CUDA_VISIBLE_DEVICES to it), else the CPU."""
    if gpus > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"this actor asked Ray for {gpus} GPU(s) but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def actor_info(role: str, index: int) -> dict[str, Any]:
    """Where this actor runs: role, index, pid, node and placement group (for the run folder's actors.json)."""
    return {"role": role, "index": index, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
            "placement_group": ray.get_runtime_context().get_placement_group_id()}


def step_seed(seed: int, step: int, worker: int) -> int:
    """Per-step, per-worker sampling seed: resuming at step k replays exactly the same noise."""
    return (seed * 1_000_003 + step * 1009 + worker) % (2**63 - 1)


@ray.remote(num_cpus=0)
def write_weights(weights: list[Any] | None, path: str) -> None:
    """Save boxed weights ([ObjectRef]) as safetensors where the checkpoint is written (the driver never holds
    them)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ray.get(weights[0]).items()}, path)


@ray.remote
class RolloutWorker:
    """Holds a policy copy; samples groups for its share of the testbed's prompts and scores them
    through the Serve ensemble."""

    def __init__(self, cfg: dict[str, Any], base_weights: dict[str, torch.Tensor], index: int, n_workers: int,
                 run_dir: str):
        """`base_weights` arrive through the object store; after a restart Ray passes them again (the controller
        keeps their ref alive)."""
        self.cfg = TrainConfig.model_validate(cfg)
        setup_process(self.cfg, Path(run_dir) / "logs" / f"rollout_{index}.log")
        self.index, self.n_workers = index, n_workers
        self.testbed = build_testbed(self.cfg)
        self.device = actor_device(self.cfg.ray.rollout_gpus)
        self.policy = self.testbed.build_policy(base_weights).to(self.device)
        self.sampler = self.testbed.build_sampler()
        self._reward = None
        self.reward_retries = 0  # scoring calls retried since the last summary (a reward replica died)
        self.version = 0  # learner updates behind the weights this worker holds (0: the base weights)
        self.weight_group: WeightBroadcastGroup | None = None  # ray.weight_sync=collective

    @property
    def reward(self) -> Any:
        """The ensemble's handle, taken at first use: workers start while the reward app is still deploying."""
        if self._reward is None:
            self._reward = serve.get_app_handle(APP_NAME)
        return self._reward

    def _score(self, batch: RolloutBatch) -> tuple[RolloutBatch, Any]:
        """Scores through the Serve ensemble; a call that fails because a replica died or timed out is retried
        (`serve.max_retries`, `serve.request_timeout_s`, `serve.retry_backoff_s`) while Serve replaces it."""
        samples, cond = self.testbed.reward_inputs(self.policy, batch)
        serve_cfg = self.cfg.serve

        def count(attempt: int, err: BaseException) -> None:
            self.reward_retries += 1

        scores = with_retries(
            lambda: self.reward.score_tensors.remote(samples, cond, batch.group).result(
                timeout_s=serve_cfg.request_timeout_s),
            serve_cfg.max_retries, serve_cfg.retry_backoff_s, "scoring through the reward ensemble", count)
        return attach_scores(batch, scores), scores

    @ray.method(num_returns=2)
    def generate(self, step: int, version: int = 0, weights: list[Any] | None = None
                 ) -> tuple[RolloutBatch, dict[str, float]]:
        """(batch for the learner, small summary for the driver), sampled with the weights of policy `version`
        (loaded first if this worker holds others: a restarted worker, or a call re-issued on it)."""
        self.set_weights(version, weights)
        gen = torch.Generator().manual_seed(step_seed(self.cfg.run.seed, step, self.index))
        prompts, group_offset = self.testbed.train_prompts(self.index, self.n_workers, step)
        t0 = time.perf_counter()
        batch = self.testbed.sample(self.sampler, self.policy, prompts, self.cfg.sampler.samples_per_class, gen,
                                    group_offset=group_offset)
        t1 = time.perf_counter()
        batch, scores = self._score(batch)
        batch = batch.with_extras(**{POLICY_VERSION: torch.full((len(batch),), self.version, dtype=torch.long)})
        t2 = time.perf_counter()
        summary = self.testbed.rollout_summary(batch, scores)
        summary.update({"timing_s/rollout": t1 - t0, "timing_s/reward": t2 - t1, "n": float(len(batch)),
                        "faults/reward_retries": float(self.reward_retries)})
        self.reward_retries = 0
        return batch, summary

    def ready(self) -> dict[str, Any]:
        """Where this worker runs (written to the run folder's actors.json)."""
        return actor_info("rollout", self.index)

    def join_weight_group(self, master_addr: str, master_port: int, size: int, backend: str) -> None:
        """Become member index+1 of the learner's weight broadcast group (`ray.weight_sync: collective`)."""
        self.weight_group = WeightBroadcastGroup(master_addr, master_port, self.index + 1, size, backend,
                                                 self.cfg.ray.step_timeout_s)

    def receive_weights(self, version: int) -> float:
        """Receive policy `version` from learner rank 0's broadcast; returns the seconds it took."""
        if self.weight_group is None:
            raise RuntimeError(f"worker {self.index} is in no weight broadcast group")
        t0 = time.perf_counter()
        load_trainable_state(self.policy, self.weight_group.receive(trainable_state(self.policy)))
        self.version = version
        return time.perf_counter() - t0

    def set_weights(self, version: int, weights: list[Any] | None) -> float:
        """Hold policy `version`: `weights` is [ObjectRef of the learner's trained tensors] (whole network, or
        LoRA adapters only; boxed so Ray does not fetch them when this worker has them already) or None for the
        base weights. Returns the seconds spent fetching and loading them."""
        if version == self.version:
            return 0.0
        if weights is None:
            raise ValueError(f"worker {self.index} holds policy version {self.version} and was sent version "
                             f"{version} without its weights")
        t0 = time.perf_counter()
        load_trainable_state(self.policy, ray.get(weights[0]))
        self.version = version
        return time.perf_counter() - t0

    def evaluate(self, seed: int, version: int = 0, weights: list[Any] | None = None) -> dict[str, Any]:
        """The testbed's held-out evaluation on seeded samples (accuracy, reward, diversity, a picture) with
        the weights of policy `version`."""
        self.set_weights(version, weights)
        gen = torch.Generator().manual_seed(seed)
        batch = self.testbed.sample(self.testbed.eval_sampler(), self.policy, self.testbed.eval_prompts(),
                                    self.testbed.eval_per_prompt, gen)
        batch, scores = self._score(batch)
        return self.testbed.eval_summary(batch, scores)
