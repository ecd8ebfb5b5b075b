"""The learner as a group of DeepSpeed ranks: one `LearnerActor` per rank, placed together in one placement
group (a GPU per bundle when `ray.learner_gpus` > 0), rendezvousing at rank 0's node address.

Every rank gets the whole batch (the same ObjectRefs) and computes advantages on all of it before taking its
prompt groups (`trainer.distributed`); gradients, `prepare` statistics and metrics are reduced across ranks,
so every rank returns the same metrics and holds the same parameters.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray
import torch
from ray.util.placement_group import remove_placement_group

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.weight_broadcast import WeightBroadcastGroup
from steadyrl.services.config import TrainConfig
from steadyrl.services.runtime.actors import actor_info, setup_process
from steadyrl.services.runtime.learner_rank import HoldsRank, build_rank, update_on
from steadyrl.services.runtime.placement import place_actors
from steadyrl.services.runtime.rank_env import actor_device
from steadyrl.services.runtime.ray_session import free_port
from steadyrl.services.runtime.remote import get_all, wait_all
from steadyrl.trainer.controls import UpdateControls
from steadyrl.trainer.learner import DeepSpeedLearner


@ray.remote
class LearnerActor(HoldsRank):
    """One DeepSpeed rank as a Ray actor around its `DeepSpeedLearner`. Constructed light; `init_engine` joins
    the process group (all ranks at once) and builds it."""

    def __init__(self, cfg: dict[str, Any], run_dir: str, rank: int = 0, world_size: int = 1):
        self.cfg, self.rank, self.world_size = TrainConfig.model_validate(cfg), rank, world_size
        self.learner: DeepSpeedLearner | None = None
        setup_process(self.cfg, Path(run_dir) / "logs" / f"learner_{rank}.log")
        if actor_device(self.cfg.ray.learner_gpus).type == "cuda":  # fails clearly when torch sees no GPU
            os.environ["DS_ACCELERATOR"] = "cuda"  # before DeepSpeed first picks its accelerator
        self.weight_group: WeightBroadcastGroup | None = None

    def rendezvous(self) -> tuple[str, int]:
        """This node's address and a free port on it: rank 0's is every rank's MASTER_ADDR/PORT."""
        return ray.util.get_node_ip_address(), free_port("")

    def init_engine(self, base_weights: dict[str, torch.Tensor], rendezvous: tuple[str, int]) -> dict[str, Any]:
        """Build the rank's learner at rank 0's (address, port); returns where this rank runs (for actors.json)."""
        self.learner = build_rank(self.cfg, base_weights, self.rank, self.world_size, *rendezvous)
        return actor_info("learner", self.rank)

    def update(self, *batches: RolloutBatch, controls: UpdateControls | None = None) -> dict[str, float]:
        """One update on the workers' batches (resolved from their ObjectRefs by Ray); its metrics."""
        return update_on(self.learner, batches, controls)

    def join_weight_group(self, master_addr: str, master_port: int, size: int, backend: str) -> None:
        """Rank 0: become member 0 (the source) of the broadcast group to the rollout workers."""
        self.weight_group = WeightBroadcastGroup(master_addr, master_port, 0, size, backend, self.cfg.ray.step_timeout_s)

    def broadcast_weights(self) -> int:
        """Every rank gathers (ZeRO-3 needs all); rank 0 broadcasts to the rollout workers. Returns bytes sent."""
        weights = self.learner.sampling_weights()
        return self.weight_group.broadcast(weights) if self.rank == 0 else 0


class LearnerGroup:
    """`learner.ranks` LearnerActors in one placement group; each call fans out to every rank (DeepSpeed's
    collectives need all of them) and returns rank 0's result."""

    def __init__(self, cfg: TrainConfig, base_weights: Any, run_dir: str | Path):
        n = cfg.learner.ranks
        cfg_dict = cfg.model_dump(mode="json")
        self.placement, self.actors = place_actors(
            LearnerActor, n, cfg.ray.actor_cpus, cfg.ray.learner_gpus, cfg.ray.learner_placement, "steadyrl-learner",
            cfg.ray.placement_timeout_s, lambda r: (cfg_dict, str(run_dir), r, n), cfg.ray.roles.learner)
        # who takes part in gathering the weights: under ZeRO-3 every rank holds a shard, else rank 0 has them all
        self.gathering = self.actors if cfg.learner.zero_stage == 3 else self.actors[:1]
        self._base_weights = base_weights
        self._init: list[ray.ObjectRef] | None = None
        self.timeout_s = cfg.ray.step_timeout_s

    def start(self) -> None:
        """Start building the engines without waiting for them (`infos` does): rank 0's rendezvous goes to every
        rank as an ObjectRef, which Ray resolves before `init_engine` runs. The actors' processes start at
        construction, so other set-up (Serve, the reward app) runs meanwhile."""
        rendezvous = self.actors[0].rendezvous.remote()
        self._init = [a.init_engine.remote(self._base_weights, rendezvous) for a in self.actors]

    def infos(self) -> list[dict[str, Any]]:
        """Where each rank runs, once every rank has joined the process group and built its engine."""
        return self._all(self._init)

    def _all(self, calls: list[ray.ObjectRef]) -> list[Any]:
        """Every rank's result; a rank that dies or hangs fails as `ComponentFailed` naming it."""
        return get_all([(self._name(r), ref) for r, ref in enumerate(calls)], self.timeout_s)

    def _name(self, rank: int) -> str:
        return "the learner" if len(self.actors) == 1 else f"learner rank {rank}"

    def update(self, batch_refs: list[ray.ObjectRef], controls: UpdateControls | None = None) -> dict[str, float]:
        """One update on the workers' batches; rank 0's metrics (every rank's are equal after the learner's
        reduction)."""
        return self.update_ranks(batch_refs, controls)[0]

    def update_ranks(self, batch_refs: list[ray.ObjectRef],
                     controls: UpdateControls | None = None) -> list[dict[str, float]]:
        """One update on the workers' batches; every rank's metrics, rank 0's first."""
        return self._all([a.update.remote(*batch_refs, controls=controls) for a in self.actors])

    def sampling_weights(self) -> ray.ObjectRef:
        """Rank 0's tensors to sample with (`Learner.sampling_weights`), left in the object store (under ZeRO-3
        every rank takes part in the gather); waited for, so a learner that dies here is named, but not fetched."""
        refs = [a.sampling_weights.remote() for a in self.gathering]
        wait_all([(self._name(r), ref) for r, ref in enumerate(refs)], self.timeout_s, check=False)
        return refs[0]

    def broadcast_weights(self) -> list[ray.ObjectRef]:
        """Rank 0's broadcast to the weight group (under ZeRO-3 every rank takes part in the gather)."""
        return [a.broadcast_weights.remote() for a in self.gathering]

    def save(self, directory: str) -> None:
        self._all([a.save.remote(directory) for a in self.actors])

    def load(self, directory: str) -> None:
        self._all([a.load.remote(directory) for a in self.actors])

    def save_batch(self, directory: str) -> None:
        """Rank 0 writes the last update's batch (every rank holds the whole batch)."""
        self._all([self.actors[0].save_batch.remote(directory)])

    def kill(self) -> None:
        for a in self.actors:
            ray.kill(a)
        remove_placement_group(self.placement)
