"""Weight sync by collective broadcast (`ray.weight_sync: collective`, gloo here, NCCL on GPUs): the group's
flat per-dtype buffers carry every tensor bitwise, and a run synced that way (with a rollout worker killed
mid-run, so the group is re-formed around its replacement) computes exactly the run synced through the object
store. Rollout workers and learner ranks each sit in a placement group of their own."""
from __future__ import annotations

import json
import os
import signal
import threading

import torch

from steadyrl.rollout.weight_broadcast import WeightBroadcastGroup
from steadyrl.services.driver.controller import ACTORS_FILE
from steadyrl.services.run_folder.metrics import read_metrics
from steadyrl.services.runtime.ray_session import free_port
from tests.helpers import SMOKE_SHORT, actor_pid, computed_metrics, steps_logged, train_in_thread, wait_for


def test_broadcast_delivers_every_tensor_of_every_dtype_bitwise():
    gen = torch.Generator().manual_seed(0)
    source = {"b.weight": torch.randn(3, 4, generator=gen), "a.bias": torch.randn(5, generator=gen),
              "c.half": torch.randn(2, 2, generator=gen).to(torch.bfloat16), "d.steps": torch.arange(7)}
    port, size = free_port(), 3
    received: dict[int, dict[str, torch.Tensor]] = {}
    sent: list[int] = []

    def member(rank: int) -> None:
        group = WeightBroadcastGroup("127.0.0.1", port, rank, size, "gloo", timeout_s=60)
        if rank == 0:
            sent.append(group.broadcast(source))
        else:
            received[rank] = group.receive({k: torch.zeros_like(v) for k, v in source.items()})

    threads = [threading.Thread(target=member, args=(r,)) for r in range(size)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert sorted(received) == [1, 2]
    for got in received.values():
        assert got.keys() == source.keys()
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in source.items())
    assert sent == [sum(v.numel() * v.element_size() for v in source.values())]


def test_a_collectively_synced_run_equals_the_object_store_run_even_across_a_worker_restart(smoke_straight,
                                                                                            digits_app, tmp_path):
    run = tmp_path / "collective"
    thread, out = train_in_thread(run, [*SMOKE_SHORT, "ray.weight_sync=collective"])
    wait_for(lambda: steps_logged(run) >= 2, "step 2")
    os.kill(actor_pid(run, "rollout_0"), signal.SIGKILL)
    thread.join(timeout=600)
    assert "error" not in out, out.get("error")
    rows = read_metrics(run)
    assert computed_metrics(rows) == computed_metrics(read_metrics(smoke_straight.run_dir))  # bitwise
    assert sum(r["faults/rollout_restarts"] for r in rows) == 1
    assert all(r["timing_s/sync"] > 0 for r in rows)
    actors = json.loads((run / ACTORS_FILE).read_text())["actors"]
    groups = {name: a["placement_group"] for name, a in actors.items()}
    assert groups["learner_0"] and groups["rollout_0"] and groups["learner_0"] != groups["rollout_0"]


def test_collective_sync_with_pipelined_rollouts_is_refused_naming_both_settings():
    import pytest

    from steadyrl.services.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"ray.weight_sync=collective needs learner.max_staleness=0"):
        load_config(None, ["ray.weight_sync=collective", "learner.max_staleness=1"])
    assert load_config(None, ["ray.weight_sync=collective"]).ray.weight_sync == "collective"
