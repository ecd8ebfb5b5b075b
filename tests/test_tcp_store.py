"""The rendezvous store of the learner ranks and the weight broadcast listens on the address it is given only
(torch's own TCPStore listens on every interface whatever its host), and serves the other members there."""
from __future__ import annotations

from datetime import timedelta

import psutil
import torch.distributed as dist

from steadyrl.rollout.tcp_store import tcp_store
from steadyrl.services.runtime.rank_env import free_port

TIMEOUT = timedelta(seconds=30)


def listening_on(port: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_the_store_listens_on_its_host_only_and_serves_the_other_members():
    port = free_port()
    server = tcp_store("127.0.0.1", port, 2, True, TIMEOUT)
    assert listening_on(port) == {"127.0.0.1"}
    member = tcp_store("127.0.0.1", port, 2, False, TIMEOUT)
    member.set("weights", "v1")
    assert server.get("weights") == b"v1"


def test_torchs_own_store_would_listen_on_every_interface():
    """Why the helper exists: the same host given to torch's TCPStore, and it binds the wildcard address."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=TIMEOUT)
    assert listening_on(port) - {"127.0.0.1"}, "torch's TCPStore now honours its host: rollout.tcp_store can go"
    del store
