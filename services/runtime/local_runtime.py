"""The local runtime: the services' interfaces in one process, without Ray or Serve (`steadyrl train --local`).

The controller runs the same loop over these as over the Ray runtime: `LocalRolloutPool` runs every worker's
share with `services.runtime.rollouts.Rollouts` (the code the Ray workers run), `LocalLearner` holds one
`DeepSpeedLearner` built as each Ray learner actor builds its own (`learner_rank.build_rank`), each on cuda where its `ray.*_gpus` asks for a GPU and torch
sees one, and rewards come from the testbed's in-process ensemble, built by the same factory as the Serve
deployments and scored on one thread as the Serve replicas score. With the same `ray.torch_threads`, a run
gives the same metrics bitwise on either runtime. For debugging (breakpoints, profilers in one process), many-seed
benchmarks, and nodes without Ray (it imports none).
"""
from __future__ import annotations

import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from safetensors.torch import load_file, save_file
from torch import Tensor

from steadyrl.reward.ensemble import EnsembleScores, RewardEnsemble
from steadyrl.rollout.numerics import using_threads
from steadyrl.rollout.policy import trainable_state
from steadyrl.services.config import TrainConfig
from steadyrl.services.run_folder.checkpoints import rollout_weights_file
from steadyrl.services.runtime.learner_rank import HoldsRank, build_rank, update_on
from steadyrl.services.runtime.malloc import keep_freed_memory
from steadyrl.services.runtime.rank_env import free_port, local_device, torch_threads
from steadyrl.services.runtime.rollouts import Rollouts
from steadyrl.services.testbeds.base import Testbed
from steadyrl.trainer.controls import UpdateControls
from steadyrl.trainer.learner import DeepSpeedLearner


def local_info(role: str, index: int) -> dict[str, Any]:
    """actors.json's entry for a component of the local runtime: it runs in the driver's process."""
    return {"role": role, "index": index, "pid": os.getpid(), "node": "local", "placement_group": None}


class LocalScorer:
    """The testbed's reward ensemble in this process, scored on one thread (as each Serve replica is)."""

    def __init__(self, ensemble: RewardEnsemble):
        self.ensemble = ensemble

    def __call__(self, samples: Any, cond: Any, group: Tensor | None) -> EnsembleScores:
        with using_threads(1):
            return self.ensemble.score_all(samples, cond, group)


class LocalLearner(HoldsRank):
    """One learner rank in this process (`learner.ranks` must be 1 here)."""

    def __init__(self, cfg: TrainConfig, base_weights: dict[str, Tensor]):
        self.cfg, self.base_weights = cfg, base_weights
        self.learner: DeepSpeedLearner | None = None

    def start(self) -> None:
        """Build the engine; the first run in a process creates its one-rank gloo group, later runs reuse it
        (DeepSpeed keeps the group it was given for the process's life)."""
        self.learner = build_rank(self.cfg, self.base_weights, 0, 1, "127.0.0.1", free_port())

    def infos(self) -> list[dict[str, Any]]:
        return [local_info("learner", 0)]

    def update(self, batches: list[Any], controls: UpdateControls | None = None) -> dict[str, float]:
        return update_on(self.learner, batches, controls)

    def shutdown(self) -> None:
        self.learner = None  # the engine and its optimiser state go with the run


class LocalRolloutPool:
    """`ray.rollout_workers` workers' shares generated one after another by one policy copy. A launch records
    the weights it samples with; the samples are drawn when the step is collected, with those weights, so
    pipelining (`learner.max_staleness`) samples exactly what the Ray pool samples."""

    def __init__(self, cfg: TrainConfig, base_weights: dict[str, Tensor], learner: LocalLearner, scorer: LocalScorer):
        self.cfg, self.learner, self.score = cfg, learner, scorer
        self.n_workers = cfg.ray.rollout_workers
        self.rollouts = Rollouts(cfg, base_weights, local_device(cfg.ray.rollout_gpus))
        self.base = (0, {k: v.clone() for k, v in trainable_state(self.rollouts.policy).items()})
        self.current = self.base  # (policy version, its trainable tensors) last published
        self.launches: dict[int, tuple[int, dict[str, Tensor]]] = {}
        self.restarts = self.restarts_this_step = 0  # nothing restarts in one process

    def start(self, learner_infos: list[dict[str, Any]]) -> None:
        """Nothing to wait for: the policy copy was built with the pool."""

    def shutdown(self) -> None:
        self.launches.clear()

    def begin_step(self) -> None:
        """Nothing restarts in one process: the fault counters stay 0."""

    def publish(self, version: int) -> float:
        weights = self.learner.sampling_weights()  # a CPU copy: later updates do not change it
        self.current = (version, weights)
        return self.rollouts.load(version, weights)

    def _hold(self, version: int, weights: dict[str, Tensor]) -> None:
        if version != self.rollouts.version:
            self.rollouts.load(version, weights)

    def launch(self, step: int, weights: tuple[int, dict[str, Tensor]] | None = None) -> None:
        self.launches[step] = weights or self.current

    def collect(self, step: int) -> tuple[list[Any], list[dict[str, float]]]:
        self._hold(*self.launches.pop(step))
        outs = [self.rollouts.generate(step, i, self.n_workers, self.score) for i in range(self.n_workers)]
        for _, summary in outs:
            summary["faults/reward_retries"] = 0.0
        self._hold(*self.current)
        return [batch for batch, _ in outs], [summary for _, summary in outs]

    def evaluate(self, seed: int) -> dict[str, Any]:
        return self.rollouts.evaluate(seed, self.score)

    def in_flight(self) -> dict[int, int]:
        return {step: version for step, (version, _) in self.launches.items()}

    def save_in_flight(self, directory: Path) -> None:
        for version, weights in {v: w for v, w in self.launches.values() if v not in (0, self.current[0])}.items():
            save_file({k: v.contiguous() for k, v in weights.items()}, str(directory / rollout_weights_file(version)))

    def discard_in_flight(self) -> None:
        """Forget the rollouts launched and not collected (a rollback: they were sampled by abandoned weights)."""
        self.launches.clear()

    def relaunch(self, in_flight: dict[str, int], directory: Path) -> None:
        for step, version in in_flight.items():
            weights = (self.base[1] if version == 0 else self.current[1] if version == self.current[0]
                       else load_file(str(directory / rollout_weights_file(version))))
            self.launch(int(step), (version, weights))


class LocalRuntime:
    """The local twin of `services.runtime.ray_runtime.RayRuntime`: the same pool and learner interfaces in this
    process. Torch runs on the threads an actor would (`ray.torch_threads`, else every core), restored after."""

    name = "local"

    def __init__(self, cfg: TrainConfig, testbed: Testbed, run_dir: Path, console: Console):
        self.cfg, self.testbed, self.run_dir, self.console = cfg, testbed, Path(run_dir), console
        self._context = ExitStack()

    def start(self, base_model: Path) -> tuple[LocalRolloutPool, LocalLearner]:
        cfg = self.cfg
        learner_device = local_device(cfg.ray.learner_gpus)
        os.environ.setdefault("DS_ACCELERATOR", learner_device.type)
        if (cfg.ray.learner_gpus > 0 or cfg.ray.rollout_gpus > 0) and not torch.cuda.is_available():
            self.console.print("ray.learner_gpus / ray.rollout_gpus ask for a GPU but torch sees no CUDA device: "
                               "the local runtime runs on the CPU", soft_wrap=True, highlight=False)
        self._context.enter_context(using_threads(torch_threads(cfg)))
        if cfg.ray.keep_freed_memory:  # for the rest of this process: glibc has no way back to its adaptive policy
            keep_freed_memory()
        base_weights = load_file(str(base_model))
        with self.console.status("building the DeepSpeed learner (in this process)"):
            self.learner = LocalLearner(cfg, base_weights)
            self.learner.start()
        self.pool = LocalRolloutPool(cfg, base_weights, self.learner, LocalScorer(self.testbed.reward_ensemble()))
        if cfg.run.progress:
            self.console.print(f"local runtime (one process, no Ray)   run folder: {self.run_dir}")
        return self.pool, self.learner

    def shutdown(self) -> None:
        if hasattr(self, "learner"):
            self.learner.shutdown()
        self._context.close()
