"""Learner -> rollout weight sync as one collective broadcast (NCCL between GPUs, gloo on the CPU).

A process group of its own, apart from the learner ranks' DeepSpeed group: learner rank 0 is member 0 (the
source), the N rollout workers members 1..N. It is built from a TCPStore at member 0's address, as OpenRLHF and
verl build theirs, so each process keeps its default group for DeepSpeed. The trained tensors travel as one flat
buffer per dtype, in sorted-name order, which every member derives from its own copy of the policy: one
broadcast per dtype instead of one per tensor, and nothing passes through the object store.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from steadyrl.rollout.tcp_store import tcp_store


class WeightBroadcastGroup:
    """One member of the broadcast group; `broadcast` on member 0, `receive` on every other, at the same time."""

    def __init__(self, master_addr: str, master_port: int, rank: int, size: int, backend: str = "gloo",
                 timeout_s: float = 600.0, tag: str = "steadyrl-weights"):
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight broadcast backend must be gloo or nccl, got {backend!r}")
        timeout = timedelta(seconds=timeout_s)
        self.rank, self.size, self.backend = rank, size, backend
        self.store = tcp_store(master_addr, master_port, size, rank == 0, timeout)
        prefixed = dist.PrefixStore(tag, self.store)
        if backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.group = dist.ProcessGroupNCCL(prefixed, rank, size)
        else:
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(prefixed, rank, size, timeout)

    def _broadcast(self, flat: Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.group.broadcast([flat], opts).wait()

    def broadcast(self, tensors: dict[str, Tensor]) -> int:
        """Member 0: send `tensors`; returns the bytes sent."""
        if self.rank != 0:
            raise RuntimeError("only member 0 (learner rank 0) broadcasts")
        sent = 0
        for dtype, names in _by_dtype(tensors).items():
            flat = torch.cat([tensors[k].detach().reshape(-1).to(self.device) for k in names])
            self._broadcast(flat)
            sent += flat.numel() * flat.element_size()
        return sent

    def receive(self, like: dict[str, Tensor]) -> dict[str, Tensor]:
        """Members 1..N: tensors shaped and typed as `like` (this member's own trainable state), filled with
        member 0's values."""
        out: dict[str, Tensor] = {}
        for dtype, names in _by_dtype(like).items():
            flat = torch.empty(sum(like[k].numel() for k in names), dtype=dtype, device=self.device)
            self._broadcast(flat)
            for name, part in zip(names, flat.split([like[k].numel() for k in names])):
                out[name] = part.view_as(like[name])
        return out


def _by_dtype(tensors: dict[str, Tensor]) -> dict[torch.dtype, list[str]]:
    """Names grouped by dtype, each group sorted: the same layout on every member."""
    groups: dict[torch.dtype, list[str]] = {}
    for name in sorted(tensors):
        groups.setdefault(tensors[name].dtype, []).append(name)
    return dict(sorted(groups.items(), key=lambda kv: str(kv[0])))
