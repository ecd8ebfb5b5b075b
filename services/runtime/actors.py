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

from steadyrl.reward.ensemble import EnsembleScores
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.policy import trainable_state
from steadyrl.rollout.weight_broadcast import WeightBroadcastGroup
from steadyrl.services.config import TrainConfig
from steadyrl.services.runtime.malloc import keep_freed_memory
from steadyrl.services.runtime.rank_env import actor_device, torch_threads
from steadyrl.services.runtime.ray_session import redirect_output
from steadyrl.services.runtime.retry import with_retries
from steadyrl.services.runtime.rollouts import Rollouts
from steadyrl.services.serving import APP_NAME


def setup_process(cfg: TrainConfig, log_file: Path) -> None:
    """An actor's process: its output to `log_file`, torch's threads, glibc's allocator (`ray.keep_freed_memory`)."""
    redirect_output(log_file)
    torch.set_num_threads(torch_threads(cfg))
    if cfg.ray.keep_freed_memory:
        keep_freed_memory()


def actor_info(role: str, index: int) -> dict[str, Any]:
    """Where this actor runs: role, index, pid, node (address and Ray's id) and placement group (for the run
    folder's actors.json)."""
    context = ray.get_runtime_context()
    return {"role": role, "index": index, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
            "node_id": context.get_node_id(), "placement_group": context.get_placement_group_id()}


@ray.remote(num_cpus=0)
def write_weights(weights: list[Any], path: str) -> None:
    """Save boxed weights ([ObjectRef]) as safetensors where the checkpoint is written (the driver never holds
    them)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in ray.get(weights[0]).items()}, path)


@ray.remote
class RolloutWorker:
    """Rollout worker `index` of `n_workers` as a Ray actor: `services.runtime.rollouts.Rollouts` (sample, score,
    summarise) scoring through the Serve ensemble, with weights from the object store or a broadcast group."""

    def __init__(self, cfg: dict[str, Any], base_weights: dict[str, torch.Tensor], index: int, n_workers: int,
                 run_dir: str):
        """`base_weights` arrive through the object store; after a restart Ray passes them again (the pool
        keeps their ref alive)."""
        self.cfg = TrainConfig.model_validate(cfg)
        setup_process(self.cfg, Path(run_dir) / "logs" / f"rollout_{index}.log")
        self.index, self.n_workers = index, n_workers
        self.rollouts = Rollouts(self.cfg, base_weights, actor_device(self.cfg.ray.rollout_gpus))
        self._reward = None
        self.reward_retries = 0  # scoring calls retried since the last summary (a reward replica died)
        self.weight_group: Any = None  # ray.weight_sync=collective: a WeightBroadcastGroup, or the engine policy

    @property
    def reward(self) -> Any:
        """The ensemble's handle, taken at first use: workers start while the reward app is still deploying."""
        if self._reward is None:
            self._reward = serve.get_app_handle(APP_NAME)
        return self._reward

    def _score(self, samples: Any, cond: Any, group: torch.Tensor | None) -> EnsembleScores:
        """Scores through the Serve ensemble; a call that fails because a replica died or timed out is retried
        (`serve.max_retries`, `serve.request_timeout_s`, `serve.retry_backoff_s`) while Serve replaces it."""
        serve_cfg = self.cfg.serve

        def count(attempt: int, err: BaseException) -> None:
            self.reward_retries += 1

        return with_retries(
            lambda: self.reward.score_tensors.remote(samples, cond, group).result(
                timeout_s=serve_cfg.request_timeout_s),
            serve_cfg.max_retries, serve_cfg.retry_backoff_s, "scoring through the reward ensemble", count)

    @ray.method(num_returns=2)
    def generate(self, step: int, version: int = 0, weights: list[Any] | None = None
                 ) -> tuple[RolloutBatch, dict[str, float]]:
        """(batch for the learner, small summary for the driver), sampled with the weights of policy `version`
        (loaded first if this worker holds others: a restarted worker, or a call re-issued on it)."""
        self.set_weights(version, weights)
        batch, summary = self.rollouts.generate(step, self.index, self.n_workers, self._score)
        summary["faults/reward_retries"] = float(self.reward_retries)
        self.reward_retries = 0
        return batch, summary

    def ready(self) -> dict[str, Any]:
        """Where this worker runs (written to the run folder's actors.json)."""
        return actor_info("rollout", self.index)

    def join_weight_group(self, master_addr: str, master_port: int, size: int, backend: str) -> None:
        """Become member index+1 of the learner's weight broadcast group (`ray.weight_sync: collective`); a policy
        that receives broadcasts itself (a vLLM engine, through its weight-transfer API) joins in its place."""
        policy, rank, timeout = self.rollouts.policy, self.index + 1, self.cfg.ray.step_timeout_s
        if hasattr(policy, "join_weight_group") and policy.join_weight_group(master_addr, master_port, rank, size,
                                                                             backend, timeout):
            self.weight_group = policy
            return
        self.weight_group = WeightBroadcastGroup(master_addr, master_port, rank, size, backend, timeout)

    def receive_weights(self, version: int) -> float:
        """Receive policy `version` from learner rank 0's broadcast; returns the seconds it took."""
        if self.weight_group is None:
            raise RuntimeError(f"worker {self.index} is in no weight broadcast group")
        t0 = time.perf_counter()
        if self.weight_group is self.rollouts.policy:  # the engine receives into its running model
            self.rollouts.policy.receive_broadcast()
            self.rollouts.version = version
            return time.perf_counter() - t0
        received = self.weight_group.receive(trainable_state(self.rollouts.policy))
        return self.rollouts.load(version, received) + (time.perf_counter() - t0)

    def set_weights(self, version: int, weights: list[Any] | None) -> float:
        """Hold policy `version`: `weights` is [ObjectRef of the learner's trained tensors] (boxed so Ray does not
        fetch them when this worker has them already) or None for the base weights. Returns the seconds spent
        fetching and loading them."""
        if version == self.rollouts.version:
            return 0.0
        if weights is None:
            raise ValueError(f"worker {self.index} holds policy version {self.rollouts.version} and was sent "
                             f"version {version} without its weights")
        t0 = time.perf_counter()
        fetched = ray.get(weights[0])
        return self.rollouts.load(version, fetched) + (time.perf_counter() - t0)

    def evaluate(self, seed: int, version: int = 0, weights: list[Any] | None = None) -> dict[str, Any]:
        """The testbed's held-out evaluation on seeded samples with the weights of policy `version`."""
        self.set_weights(version, weights)
        return self.rollouts.evaluate(seed, self._score)
