"""A torch.distributed rendezvous store whose server listens on the address it is given, and nowhere else.

torch's `TCPStore(host, port, is_master=True)` listens on every interface whatever `host` says; a socket bound to
`host` and handed to it (`master_listen_fd`) keeps a rendezvous on 127.0.0.1 on loopback, and one at a node's
address on that node's interface. The process groups of the learner ranks and of the weight broadcast meet here.
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def tcp_store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """Member 0 (`is_master`) serves the store on (`host`, `port`); the others connect to it."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen()
    except OSError:
        sock.close()
        raise
    # the store owns the listening socket from here (detach: Python no longer closes it); the members meet in the
    # process group's own rendezvous, so the server does not wait for them here
    return dist.TCPStore(host, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach(), use_libuv=True)
