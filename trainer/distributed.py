"""Data-parallel learner ranks: which prompt groups a rank trains on, and the collectives that keep the
ranks one learner (a step's term count, the objectives' `prepare` statistics, the update's metrics).

Every rank receives the whole batch and computes its advantages and gates on all of it (so GRPO's group
statistics and any batch-wide normaliser see every sample), then trains on its own prompt groups. Each rank
back-propagates `world_size x` its pieces' share of the step's loss; DeepSpeed's gradient all-reduce
averages over ranks, so the optimiser sees the sum over every piece on every rank: the 1-rank gradient.
Without torch.distributed initialised (or with one rank) every function here is the identity.
"""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Sequence, TypeVar

import torch
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, world size) of this process's learner group; (0, 1) outside torch.distributed."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def group_shares(batch: RolloutBatch, size: int) -> list[Tensor]:
    """Sample indices of each rank's share: the prompt groups, sorted by id, dealt out round-robin
    (g_0 -> rank 0, g_1 -> rank 1, ...), so a group's samples never straddle two ranks."""
    groups = batch.group.unique(sorted=True)
    if len(groups) < size:
        raise ValueError(f"the batch has {len(groups)} prompt groups, fewer than learner.ranks={size}: every "
                         "rank needs at least one whole group")
    return [torch.nonzero(torch.isin(batch.group, groups[r::size])).flatten() for r in range(size)]


def micro_batch_count(shares: Sequence[int], micro_batch_size: int) -> int:
    """Micro-batches per rank: the largest share's count. Every rank runs the same number of forward and
    backward passes (ZeRO's collectives and the gradient all-reduce pair them up), so smaller shares are cut
    into as many, smaller, micro-batches."""
    return max(math.ceil(n / micro_batch_size) for n in shares)


def split_into(batch: RolloutBatch, count: int, micro_batch_size: int) -> list[RolloutBatch]:
    """`batch` as `count` micro-batches of at most `micro_batch_size`: consecutive slices of that size when
    that gives `count`, else `count` near-equal slices."""
    pieces = batch.split(micro_batch_size)
    if len(pieces) == count:
        return pieces
    if len(batch) < count:
        raise ValueError(f"a rank's share of {len(batch)} samples cannot fill the {count} micro-batches the "
                         "largest share needs: use fewer learner.ranks or a larger learner.micro_batch_size")
    return [batch.index(idx) for idx in torch.arange(len(batch)).tensor_split(count)]


def step_extent(local: int) -> tuple[int, int]:
    """(samples of an optimisation step on all ranks, samples of it on lower ranks), from this rank's `local`."""
    rank, size = world()
    if size == 1:
        return local, 0
    counts = all_gather(local)
    return sum(counts), sum(counts[:rank])


def all_sum(value: float) -> float:
    """Sum of `value` over the ranks."""
    rank, size = world()
    if size == 1:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=_device())
    torch.distributed.all_reduce(t)
    return float(t.item())


def all_gather(obj: T) -> list[T]:
    """Every rank's `obj` (picklable; tensors on the CPU), in rank order."""
    rank, size = world()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    torch.distributed.all_gather_object(out, obj)
    return out


def gather_pieces(pieces: list[Any], rows_before: int) -> list[Any]:
    """The `prepare` pieces of every rank, their `rows` renumbered into the step's global row order
    (rank 0's rows first); `rows_before` is the number of the step's samples on lower ranks."""
    _, size = world()
    if size == 1:
        return pieces
    local = [replace(p, rows=p.rows + rows_before) for p in pieces]
    cpu = [_to_cpu(p) for p in local]
    return [p for rank_pieces in all_gather(cpu) for p in rank_pieces]


def reduce_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """Each metric over the ranks: the maximum for `*_max` and `*_alarm`, else the mean."""
    _, size = world()
    if size == 1:
        return metrics
    every = all_gather(metrics)
    out: dict[str, float] = {}
    for key in sorted({k for m in every for k in m}):
        values = [m[key] for m in every if key in m]
        out[key] = max(values) if key.endswith(("_max", "_alarm")) else sum(values) / len(values)
    return out


def _device() -> torch.device:
    """The device collectives run on: cuda under NCCL, the CPU under gloo."""
    backend = torch.distributed.get_backend()
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _to_cpu(piece: Any) -> Any:
    """A dataclass piece with its tensors (and lists of tensors' holders) detached onto the CPU."""
    changes = {}
    for name, value in vars(piece).items():
        if isinstance(value, Tensor):
            changes[name] = value.detach().cpu()
    return replace(piece, **changes)
