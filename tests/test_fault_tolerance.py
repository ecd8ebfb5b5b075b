"""Fault tolerance, by killing the real processes (SIGKILL) of a running job: a rollout worker killed mid-run is
restarted and its call re-issued, a reward replica killed is replaced by Serve and the scoring call retried, and
neither loses or duplicates a sample: the run's metrics equal those of the run nobody killed. A learner that dies
with no restarts allowed (run.max_restarts=0) fails the run cleanly, with the last checkpoint intact and a message
saying how to resume (the restart itself: tests/test_async_rollouts.py, tests/test_multinode.py)."""
from __future__ import annotations

import json
import os
import signal
import time

import pytest
import ray
from ray import serve

from steadyrl.services.driver.controller import ACTORS_FILE, RunFailed, train
from steadyrl.services.run_folder.recoveries import RECOVERIES_LOG
from steadyrl.services.run_folder.metrics import read_metrics
from steadyrl.services.runtime.retry import is_process_failure, with_retries
from steadyrl.services.serving import APP_NAME
from tests.helpers import SMOKE_SHORT, actor_pid, computed_metrics, steps_logged, train_in_thread, wait_for

SAMPLES_PER_STEP = 10 * 4  # ten digit classes x sampler.group_size=4


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _replica(deployment: str) -> tuple[str, int]:
    """(actor name, pid) of the one replica of the reward app's `deployment`."""
    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(f"SERVE_REPLICA::{APP_NAME}#{deployment}#")]
    assert len(names) == 1, names
    handle = ray.get_actor(names[0], namespace="serve")
    return names[0], ray.get(handle.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def test_only_process_failures_and_timeouts_are_retried(ray_cluster):
    @ray.remote(max_restarts=0)
    class Victim:
        def pid(self) -> int:
            return os.getpid()

        def slow(self) -> None:
            time.sleep(60)

        def bad(self) -> None:
            raise ValueError("bad input")

    victim = Victim.remote()
    pid = ray.get(victim.pid.remote())
    pending = victim.slow.remote()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(ray.exceptions.RayActorError) as died:
        ray.get(pending, timeout=60)
    assert is_process_failure(died.value)
    other = Victim.remote()
    with pytest.raises(ray.exceptions.RayTaskError) as raised:
        ray.get(other.bad.remote())
    assert not is_process_failure(raised.value)
    with pytest.raises(ray.exceptions.GetTimeoutError) as late:
        ray.get(other.slow.remote(), timeout=0.1)
    assert is_process_failure(late.value)
    ray.kill(other)

    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ray.exceptions.ActorDiedError()
        return "scored"

    assert with_retries(flaky, retries=2, first_backoff_s=0.0, what="flaky") == "scored" and len(calls) == 3
    calls.clear()
    with pytest.raises(ray.exceptions.ActorDiedError):  # the bound holds
        with_retries(flaky, retries=1, first_backoff_s=0.0, what="flaky")
    assert len(calls) == 2
    with pytest.raises(ValueError):  # the callee's own error is not retried
        with_retries(lambda: calls.append(1) or (_ for _ in ()).throw(ValueError("x")), 5, 0.0, "bad")


def test_killed_rollout_worker_and_reward_replica_are_replaced_without_losing_a_sample(smoke_straight, digits_app,
                                                                                       tmp_path):
    run = tmp_path / "faults"
    thread, out = train_in_thread(run, SMOKE_SHORT)
    wait_for(lambda: steps_logged(run) >= 1, "step 1")
    first_worker = actor_pid(run, "rollout_0")
    os.kill(first_worker, signal.SIGKILL)  # step 2 is under way
    wait_for(lambda: steps_logged(run) >= 3, "step 3")
    name, first_replica = _replica("ensemble")  # hosts the reward models (configs/smoke.yaml: serve.colocate_models)
    os.kill(first_replica, signal.SIGKILL)  # the next scoring call meets it dead
    thread.join(timeout=600)
    assert "error" not in out, out.get("error")
    assert out["result"].steps_done == 6

    rows = read_metrics(run)
    assert computed_metrics(rows) == computed_metrics(read_metrics(smoke_straight.run_dir))  # bitwise
    assert [r["rollout/samples"] for r in rows] == [SAMPLES_PER_STEP] * 6  # none lost, none twice
    assert [r["policy/samples"] for r in rows] == [SAMPLES_PER_STEP] * 6
    assert sum(r["faults/rollout_restarts"] for r in rows) == 1
    actors = json.loads((run / ACTORS_FILE).read_text())
    assert actors["rollout_restarts"] == 1 and actors["actors"]["rollout_0"]["pid"] != first_worker
    # Scoring after the kill needed a live replica: Serve's replacement (the killed process cannot answer). A call
    # that met the dead one was retried (faults/reward_retries; the retry path itself: the test above).
    print("reward calls retried:", sum(r["faults/reward_retries"] for r in rows), "replica killed:", name)


def test_a_dead_learner_without_restarts_fails_the_run_with_the_checkpoint_intact_and_says_how_to_resume(
        smoke_straight, digits_app, tmp_path):
    run = tmp_path / "learner-dies"
    thread, out = train_in_thread(run, [*SMOKE_SHORT, "run.max_restarts=0"])
    wait_for(lambda: steps_logged(run) >= 4, "step 4 (after the step-3 checkpoint)")
    os.kill(actor_pid(run, "learner_0"), signal.SIGKILL)
    thread.join(timeout=300)
    err = out.get("error")
    assert isinstance(err, RunFailed), out
    message = str(err)
    assert "the learner died during step" in message and f"steadyrl train --resume {run}" in message, message
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_3" and not list(ckpts.glob(".*tmp*"))
    # the run stopped its own actors and left the reward app it found serving (the session's)
    wait_for(lambda: not _alive(actor_pid(run, "rollout_0")), "the rollout worker to be stopped", 60)
    assert serve.status().applications[APP_NAME].status == "RUNNING"
    # intact: resuming from it trains step 4 exactly as the run nobody killed did
    assert not (run / RECOVERIES_LOG).exists()
    resumed = train(resume_dir=run, overrides=["run.steps=4"])
    assert resumed.steps_done == 4
    rows = computed_metrics(read_metrics(run))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows == computed_metrics(read_metrics(smoke_straight.run_dir))[:4]
