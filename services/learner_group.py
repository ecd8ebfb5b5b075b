"""The learner as a group of DeepSpeed ranks: one `LearnerActor` per rank, placed together in one placement
group (a GPU per bundle when `ray.learner_gpus` > 0), rendezvousing at rank 0's node address.

Every rank gets the whole batch (the same ObjectRefs) and computes advantages on all of it before taking its
prompt groups (`trainer.distributed`); gradients, `prepare` statistics and metrics are reduced across ranks,
so every rank returns the same metrics and holds the same parameters.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.services.actors import actor_device, actor_info, setup_process
from steadyrl.services.builders import build_learner
from steadyrl.services.config import TrainConfig
from steadyrl.services.runtime import free_port, set_rank_env
from steadyrl.services.testbeds import build_testbed
from steadyrl.trainer.weight_broadcast import WeightBroadcastGroup


@ray.remote
class LearnerActor:
    """One DeepSpeed rank. Constructed light; `init_engine` joins the process group (all ranks at once)."""

    def __init__(self, cfg: dict[str, Any], run_dir: str, rank: int = 0, world_size: int = 1):
        self.cfg = TrainConfig.model_validate(cfg)
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        setup_process(self.cfg, Path(run_dir) / "logs" / f"learner_{rank}.log")
        if actor_device(self.cfg.ray.learner_gpus).type == "cuda":  # fails clearly when torch sees no GPU
            os.environ["DS_ACCELERATOR"] = "cuda"  # before DeepSpeed first picks its accelerator
        self.learner = None
        self.weight_group: WeightBroadcastGroup | None = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it: rank 0's is every rank's MASTER_ADDR/PORT."""
        return ray.util.get_node_ip_address(), free_port("")

    def init_engine(self, base_weights: dict[str, torch.Tensor], master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group and build the engine; returns where this rank runs (for actors.json)."""
        set_rank_env(master_port, self.rank, self.world_size, master_addr)
        torch.manual_seed(self.cfg.run.seed)
        testbed = build_testbed(self.cfg)
        self.learner = build_learner(self.cfg, testbed.build_policy(base_weights).train(), testbed.build_sampler())
        return actor_info("learner", self.rank)

    def join_weight_group(self, master_addr: str, master_port: int, size: int, backend: str) -> None:
        """Rank 0: become member 0 (the source) of the broadcast group to the rollout workers."""
        self.weight_group = WeightBroadcastGroup(master_addr, master_port, 0, size, backend, self.cfg.ray.step_timeout_s)

    def broadcast_weights(self) -> int:
        """Every rank gathers (ZeRO-3 needs all); rank 0 broadcasts to the rollout workers. Returns bytes sent."""
        weights = self.learner.weights()
        return self.weight_group.broadcast(weights) if self.rank == 0 else 0

    def update(self, *batches: RolloutBatch) -> dict[str, float]:
        t0 = time.perf_counter()
        metrics = self.learner.update(RolloutBatch.concat(batches))
        metrics["timing_s/update"] = time.perf_counter() - t0
        return metrics

    def weights(self) -> dict[str, torch.Tensor]:
        return self.learner.weights()

    def save(self, directory: str) -> None:
        self.learner.save(Path(directory))

    def load(self, directory: str) -> None:
        self.learner.load(Path(directory))


class LearnerGroup:
    """`learner.ranks` LearnerActors in one placement group; each call fans out to every rank (DeepSpeed's
    collectives need all of them) and returns rank 0's result."""

    def __init__(self, cfg: TrainConfig, base_weights: Any, run_dir: str | Path):
        n = cfg.learner.ranks
        self.placement = reserve_bundles(n, cfg.ray.actor_cpus, cfg.ray.learner_gpus, cfg.ray.learner_placement,
                                         "steadyrl-learner", cfg.ray.placement_timeout_s)
        cfg_dict = cfg.model_dump(mode="json")
        self.actors = [
            LearnerActor.options(
                num_cpus=cfg.ray.actor_cpus, num_gpus=cfg.ray.learner_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement, placement_group_bundle_index=r),
            ).remote(cfg_dict, str(run_dir), r, n)
            for r in range(n)
        ]
        # who takes part in gathering the weights: under ZeRO-3 every rank holds a shard, else rank 0 has them all
        self.gathering = self.actors if cfg.learner.zero_stage == 3 else self.actors[:1]
        self._base_weights = base_weights
        self._init: list[ray.ObjectRef] | None = None

    def ready(self) -> list[ray.ObjectRef]:
        """Start the engines (rank 0's address is the rendezvous) and return refs that resolve once every rank
        has joined the process group and built its engine (to where each rank runs). The actors' processes
        start at construction, so other set-up (the reward app) can run meanwhile."""
        if self._init is None:
            addr, port = ray.get(self.actors[0].rendezvous.remote())
            self._init = [a.init_engine.remote(self._base_weights, addr, port) for a in self.actors]
        return self._init

    def update(self, *batch_refs: ray.ObjectRef) -> list[ray.ObjectRef]:
        """Every rank's metrics (equal after the learner's reduction); rank 0's is the first."""
        return [a.update.remote(*batch_refs) for a in self.actors]

    def weights(self) -> ray.ObjectRef:
        """Rank 0's trained tensors (under ZeRO-3 every rank takes part in the gather)."""
        return [a.weights.remote() for a in self.gathering][0]

    def broadcast_weights(self) -> list[ray.ObjectRef]:
        """Rank 0's broadcast to the weight group (under ZeRO-3 every rank takes part in the gather)."""
        return [a.broadcast_weights.remote() for a in self.gathering]

    def save(self, directory: str) -> None:
        ray.get([a.save.remote(directory) for a in self.actors])

    def load(self, directory: str) -> None:
        ray.get([a.load.remote(directory) for a in self.actors])

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.placement)


def reserve_bundles(n: int, cpus: float, gpus: float, strategy: str, name: str, timeout_s: float) -> PlacementGroup:
    """A placement group of n bundles of `cpus` CPUs (and `gpus` GPUs when > 0), one actor each; waits until it
    is reserved (`wait_for_placement`)."""
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {})}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=name)
    wait_for_placement(pg, timeout_s, f"{n} bundle(s) of {bundle} for {name}")
    return pg


def wait_for_placement(pg: PlacementGroup, timeout_s: float, what: str) -> None:
    """Block until the placement group's bundles are reserved, or fail naming what could not be placed."""
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"Ray could not reserve {what} within {timeout_s:.0f} s (ray.placement_timeout_s): "
                           f"the cluster has {ray.cluster_resources()}") from None
