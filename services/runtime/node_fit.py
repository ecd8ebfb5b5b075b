"""Whether any live node could ever host each role's actors, checked once Ray is up and before any actor or
placement group asks: a label, custom resource or GPU that no node has is an error naming the role and its
settings, not a placement that waits `ray.placement_timeout_s` (or a Serve replica retried forever).

A node fits one actor of a role when its labels include the role's labels and its total resources cover the
actor's demand: for every resource k, demand_k <= node_total_k. Totals, not what is free now: a busy node is a
wait, a node that lacks the resource is a mistake."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import ray

from steadyrl.services.config import ConfigError, RolePlacement, TrainConfig
from steadyrl.services.serving import replica_gpus
from steadyrl.services.testbeds.base import Testbed


class RoleUnplaceable(ConfigError):
    """No live node could host some role's actors: the settings and the cluster disagree, before anything ran."""


@dataclass(frozen=True)
class RoleDemand:
    """One actor of a role: the resources it asks for, the node labels it needs, and the settings behind them."""

    role: str
    settings: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def fits(self, node: dict[str, Any]) -> bool:
        """`node` as `ray.nodes()` lists it (live, with `Resources` totals and `Labels`)."""
        have, labels = node.get("Resources") or {}, node.get("Labels") or {}
        return (all(labels.get(k) == v for k, v in self.labels.items())
                and all(have.get(k, 0.0) >= amount for k, amount in self.resources.items() if amount > 0))


def role_demand(role: str, settings: str, cpus: float, gpus: float, placement: RolePlacement) -> RoleDemand:
    """One actor's demand: `cpus` CPUs, `gpus` GPUs (when > 0), and the role's custom resources and labels."""
    return RoleDemand(role, settings, placement.bundle(cpus, gpus), dict(placement.labels))


def reward_demand(cfg: TrainConfig, testbed: Testbed) -> RoleDemand:
    """One reward replica's demand: `serve.replica_cpus`, its GPU share where a model runs on cuda, the role's."""
    return role_demand("reward replicas", "serve.replica_cpus, serve.replica_gpus, ray.roles.reward",
                       cfg.serve.replica_cpus, replica_gpus(testbed.reward_spec(), cfg.serve), cfg.ray.roles.reward)


def training_demands(cfg: TrainConfig) -> list[RoleDemand]:
    """The rollout workers' and the learner ranks' demands."""
    ray_cfg = cfg.ray
    return [role_demand("rollout workers", "ray.actor_cpus, ray.rollout_gpus, ray.roles.rollout",
                        ray_cfg.actor_cpus, ray_cfg.rollout_gpus, ray_cfg.roles.rollout),
            role_demand("learner ranks", "ray.actor_cpus, ray.learner_gpus, ray.roles.learner",
                        ray_cfg.actor_cpus, ray_cfg.learner_gpus, ray_cfg.roles.learner)]


def check_roles_fit(demands: list[RoleDemand], nodes: list[dict[str, Any]] | None = None) -> None:
    """Raise `RoleUnplaceable` naming every role no live node fits (`nodes`: `ray.nodes()` by default), with
    what each node offers."""
    alive = [n for n in (ray.nodes() if nodes is None else nodes) if n.get("Alive")]
    misfits = [d for d in demands if not any(d.fits(n) for n in alive)]
    if not misfits:
        return
    lines = [f"the {d.role} ({d.settings}) need a node with {_describe(d.resources, d.labels)}: no live node "
             "has one" for d in misfits]
    offered = [f"  node {n.get('NodeManagerAddress')}: {_describe(_plain(n.get('Resources') or {}), _own(n))}"
               for n in alive]
    autoscaling = "(on an autoscaling cluster, whose nodes start on demand: ray.check_nodes=false)"
    raise RoleUnplaceable("\n".join([*lines, "the cluster's nodes:", *offered, autoscaling]))


def _describe(resources: dict[str, float], labels: dict[str, str]) -> str:
    res = ", ".join(f"{k}={v:g}" for k, v in sorted(resources.items()))
    return f"{{{res}}}" + (f" and labels {labels}" if labels else "")


def _plain(resources: dict[str, float]) -> dict[str, float]:
    """A node's resources without Ray's per-node markers (node:<ip>, accelerator types) and memory figures."""
    return {k: v for k, v in resources.items()
            if not k.startswith(("node:", "accelerator_type:")) and k not in ("memory", "object_store_memory")}


def _own(node: dict[str, Any]) -> dict[str, str]:
    """A node's labels without the ones Ray sets itself (ray.io/...)."""
    return {k: v for k, v in (node.get("Labels") or {}).items() if not k.startswith("ray.io/")}
