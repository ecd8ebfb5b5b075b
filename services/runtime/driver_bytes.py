"""What passes through the driver: bytes of the values the controller's process fetches from Ray, per step.

Batches are meant to stay in the object store (rollout worker -> learner ranks as ObjectRefs) and the driver to
fetch small summaries, metrics and evaluation grids only. `DRIVER_FETCHES` counts, at every place the driver
fetches a value (`remote.wait_all`/`get_all`, the rollout pool's waits), that value's bytes:

    bytes(x) = sum of tensors' and numpy arrays' nbytes + len(pickle.dumps(y)) of every other leaf y

(recursing into dicts, lists, tuples and dataclasses; tensors are never pickled), plus the step's batches that
Ray returned inline to the driver (objects under its `max_direct_call_object_size`, 100 KB by default, travel
in the task's reply to their owner, the driver, which then ships them to the learner as arguments).
Across nodes, the bytes that must cross between object stores are counted from where Ray holds each object
(`ray.experimental.get_object_locations`) and which nodes read it:

    cross(x) = size(x) * |nodes reading x  -  nodes holding x|

for each step's batches (held where a rollout worker made them, read by the learner ranks' nodes) and each
published policy's weights (made on the learner's node, read by the rollout workers' nodes; `ray.weight_sync:
object_store`). Ray moves an object to a node once, whatever the number
of readers there. On one node both are 0.
The controller logs them per step as `handoff/*` (`DriverBytes.take`); evaluations run between steps and are
kept apart (`DriverBytes.evaluations`, in the driver process: read by benchmarks/handoff.py). The local runtime
fetches nothing: a sample never leaves its one process, and every `handoff/*` figure is 0 there.
"""
from __future__ import annotations

import dataclasses
import os
import pickle
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch


def value_bytes(value: Any) -> tuple[int, int]:
    """(bytes, tensor bytes) of a fetched value: tensors and numpy arrays by nbytes (the tensor part), dicts,
    lists, tuples, sets and dataclass instances recursed into, any other leaf as `len(pickle.dumps(leaf))`."""
    if isinstance(value, torch.Tensor):
        n = value.numel() * value.element_size()
        return n, n
    if isinstance(value, np.ndarray):
        return value.nbytes, value.nbytes
    if isinstance(value, dict):
        parts = [value_bytes(k) for k in value] + [value_bytes(v) for v in value.values()]
    elif isinstance(value, (list, tuple, set, frozenset)):
        parts = [value_bytes(v) for v in value]
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        parts = [value_bytes(getattr(value, f.name)) for f in dataclasses.fields(value)]
    else:
        return len(pickle.dumps(value)), 0
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def inline_limit() -> int:
    """The largest object Ray returns inline to its owner (`max_direct_call_object_size`: 100 KiB unless
    $RAY_max_direct_call_object_size sets it); a bigger one is always stored in an object-store node."""
    return int(os.environ.get("RAY_max_direct_call_object_size", 100 * 1024))


@dataclass
class DriverBytes:
    """Running totals since the last `take`: everything fetched, its tensor part, batches inlined into the driver,
    and the step's batch bytes (object store and inlined: what the learner receives, for scale). Evaluations
    are counted apart, one {step, bytes, tensor_bytes} each in `evaluations` (`evaluated`)."""

    total: int = 0
    tensor: int = 0
    inlined: int = 0
    batches: int = 0
    cross_batches: int = 0
    cross_weights: int = 0
    evaluations: list[dict[str, int]] = field(default_factory=list)

    def fetched(self, value: Any) -> Any:
        """Count a value the driver fetched; returns it."""
        total, tensor = value_bytes(value)
        self.total += total
        self.tensor += tensor
        return value

    def batch_refs(self, refs: Sequence[Any], readers: set[str] = frozenset()) -> None:
        """Count a step's batch refs (their tasks done): each one's serialized size, those Ray holds in the
        driver's own memory store (inlined: no object-store node holds them, nor spilled them) as bytes that reached
        the driver, and those stored on a node other than the nodes in `readers` (the learner ranks') as bytes
        that cross between object stores."""
        import ray  # the Ray runtime's alone: the local runtime counts nothing and runs without Ray

        for info in ray.experimental.get_object_locations(list(refs)).values():
            size = int(info.get("object_size") or 0)
            self.batches += size
            # a location not reported yet also reads as no node: only an object Ray could inline counts
            if size <= inline_limit() and not info.get("node_ids") and not info.get("did_spill"):
                self.inlined += size
            elif info.get("node_ids"):
                self.cross_batches += size * len(set(readers) - set(info["node_ids"]))

    def weights_ref(self, ref: Any, origin: set[str], readers: set[str]) -> None:
        """Count published weights: their size once for each node in `readers` (the rollout workers') other than
        the `origin` nodes that made them (the learner's; asked after the workers fetched them, Ray would list
        their nodes as holders too)."""
        import ray

        info = ray.experimental.get_object_locations([ref])[ref]
        self.cross_weights += int(info.get("object_size") or 0) * len(set(readers) - set(origin))

    def take(self) -> dict[str, float]:
        """The `handoff/*` metrics since the last take, and start again at 0. Inlined batches are sample tensors:
        they count in `driver_bytes` and `driver_tensor_bytes` both."""
        out = {"handoff/driver_bytes": float(self.total + self.inlined),
               "handoff/driver_tensor_bytes": float(self.tensor + self.inlined),
               "handoff/driver_inlined_bytes": float(self.inlined), "handoff/batch_bytes": float(self.batches),
               "handoff/cross_node_batch_bytes": float(self.cross_batches),
               "handoff/cross_node_weight_bytes": float(self.cross_weights)}
        self.total = self.tensor = self.inlined = self.batches = self.cross_batches = self.cross_weights = 0
        return out

    def evaluated(self, step: int) -> None:
        """Record what was fetched since the last take as the evaluation at `step` (the grid of samples and its
        summary), apart from the steps' figures, and start again at 0."""
        taken = self.take()
        self.evaluations.append({"step": step, "bytes": int(taken["handoff/driver_bytes"]),
                                 "tensor_bytes": int(taken["handoff/driver_tensor_bytes"])})


#: the driver process's counter: the fetch helpers add to it, the controller takes it once per step
DRIVER_FETCHES = DriverBytes()
