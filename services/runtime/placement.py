"""Placing a role's actors: a placement group of one bundle per actor, then one actor pinned to each bundle
(the learner group's ranks, the rollout pool's workers)."""
from __future__ import annotations

from typing import Any, Callable

import ray
from ray.actor import ActorClass, ActorHandle
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from steadyrl.services.config import RolePlacement


def place_actors(actor: ActorClass, n: int, cpus: float, gpus: float, strategy: str, name: str, timeout_s: float,
                 args: Callable[[int], tuple[Any, ...]], role: RolePlacement | None = None,
                 **options: Any) -> tuple[PlacementGroup, list[ActorHandle]]:
    """`n` bundles reserved (`reserve_bundles`, on the nodes `role` names) and actor i = `actor(*args(i))` in
    bundle i, with `cpus`/`gpus` and any further actor `options` (restarts, retries)."""
    pg = reserve_bundles(n, cpus, gpus, strategy, name, timeout_s, role)
    actors = [actor.options(num_cpus=cpus, num_gpus=gpus, **options,
                            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                            ).remote(*args(i))
              for i in range(n)]
    return pg, actors


def reserve_bundles(n: int, cpus: float, gpus: float, strategy: str, name: str, timeout_s: float,
                    role: RolePlacement | None = None) -> PlacementGroup:
    """A placement group of n bundles of `cpus` CPUs (and `gpus` GPUs when > 0, and `role`'s custom resources),
    one actor each, on nodes carrying `role`'s labels; waits until it is reserved (`wait_for_placement`)."""
    role = role or RolePlacement()
    bundle = role.bundle(cpus, gpus)
    selector = {"bundle_label_selector": [dict(role.labels) for _ in range(n)]} if role.labels else {}
    pg = placement_group([dict(bundle) for _ in range(n)], strategy=strategy, name=name, **selector)
    on = f" on nodes labelled {role.labels}" if role.labels else ""
    wait_for_placement(pg, timeout_s, f"{n} bundle(s) of {bundle}{on} for {name}")
    return pg


def wait_for_placement(pg: PlacementGroup, timeout_s: float, what: str) -> None:
    """Block until the placement group's bundles are reserved, or fail naming what could not be placed."""
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        raise RuntimeError(f"Ray could not reserve {what} within {timeout_s:.0f} s (ray.placement_timeout_s): "
                           f"the cluster has {ray.cluster_resources()}") from None
