"""A process's environment as a DeepSpeed rank, its torch threads, its device and free ports (no Ray: the local
runtime uses them too)."""
from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch

from steadyrl.rollout.cache import torch_extensions_dir
from steadyrl.rollout.tcp_store import tcp_store
from steadyrl.services.config import TrainConfig


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` ("" = every interface, as a rendezvous other nodes connect to needs)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def set_rank_env(master_port: int, rank: int = 0, world_size: int = 1, master_addr: str = "127.0.0.1") -> None:
    """The environment one DeepSpeed rank of this process needs (gloo on CPU), and the cached compiled ops."""
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR=master_addr,
                      MASTER_PORT=str(master_port))


def join_process_group(backend: str, rank: int, world_size: int, master_addr: str, master_port: int,
                       timeout_s: float = 1800.0) -> None:
    """This process as `rank` of the default process group, met at rank 0's store on (`master_addr`,
    `master_port`), listening on that address only (`rollout.tcp_store`); DeepSpeed then uses the group as it is."""
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    store = tcp_store(master_addr, master_port, world_size, rank == 0, timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def torch_threads(cfg: TrainConfig, cores: int | None = None) -> int:
    """ray.torch_threads, else every core of the node when the phases run one after another, and half of them
    under pipelining (learner.max_staleness > 0), where rollout and learner compute at the same time: two
    processes with a thread per core each oversubscribe the node (on 2 cores both ran 2-7x slower)."""
    if cfg.ray.torch_threads:
        return cfg.ray.torch_threads
    cores = cores or os.cpu_count() or 1
    return max(1, cores // 2) if cfg.learner.max_staleness > 0 else cores


def actor_device(gpus: float) -> torch.device:
    """cuda when this actor was given a GPU (Ray sets CUDA_VISIBLE_DEVICES to it), else the CPU."""
    if gpus > 0:
        if not torch.cuda.is_available():
            raise RuntimeError(f"this actor asked Ray for {gpus} GPU(s) but torch sees no CUDA device")
        return torch.device("cuda")
    return torch.device("cpu")


def local_device(gpus: float) -> torch.device:
    """The local runtime's device for a part that asks for `gpus`: cuda where torch sees one, else the CPU (a
    GPU preset still runs on a laptop, more slowly)."""
    return torch.device("cuda") if gpus > 0 and torch.cuda.is_available() else torch.device("cpu")
