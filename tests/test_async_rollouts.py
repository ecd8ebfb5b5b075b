"""One-step-off-policy pipelining through the real services (learner.max_staleness=1): rollouts of step k+1 are
sampled with the weights of step k-1 while the learner trains on step k, each batch carries its policy version,
the learner weights the lagged terms by pi_prox/pi_b, and a run killed mid-way resumes to the very same run
(the in-flight rollout's older weights are in the checkpoint)."""
from __future__ import annotations

import os
import signal

import pytest

from steadyrl.services.config import CONFIG_DIR
from steadyrl.services.driver.controller import train
from steadyrl.services.run_folder.recoveries import read_recoveries
from steadyrl.services.run_folder.metrics import read_metrics
from tests.helpers import (SMOKE_SHORT, actor_pid, computed_metrics, ensure_digits_app, steps_logged,
                           train_in_thread, wait_for)

SMOKE = CONFIG_DIR / "smoke.yaml"
ASYNC = [*SMOKE_SHORT, "learner.max_staleness=1"]


@pytest.fixture(scope="module")
def async_run(ray_cluster, serve_port, tmp_path_factory):
    ensure_digits_app()
    result = train(SMOKE, [f"run.run_dir={tmp_path_factory.mktemp('async') / 'straight'}", *ASYNC])
    assert result.steps_done == 6
    return result


def test_pipelined_batches_lag_one_update_and_are_reweighted(async_run, smoke_straight):
    rows = read_metrics(async_run.run_dir)
    # step 1 samples the base policy the learner still has; every later batch was sampled one update back
    assert [r["async/staleness_max"] for r in rows] == [0.0] + [1.0] * 5
    assert rows[0]["async/behaviour_weight_mean"] == 1.0
    for r in rows[1:]:
        assert r["async/behaviour_weight_mean"] != 1.0 and r["async/behaviour_weight_max"] <= 2.0
        assert r["async/behaviour_weight_min"] > 0.0
    assert [r["rollout/samples"] for r in rows] == [40.0] * 6 and [r["policy/samples"] for r in rows] == [40.0] * 6
    sync = read_metrics(smoke_straight.run_dir)
    # the first step is the same computation (on half the threads: float32 sums in another order); from the
    # second the batches come from other weights
    same = ("reward/train_mean", "policy/ratio_mean", "policy/grad_norm")
    assert all(rows[0][k] == pytest.approx(sync[0][k], rel=1e-3) for k in same)
    assert rows[1]["reward/train_mean"] != sync[1]["reward/train_mean"]


def test_a_pipelined_run_whose_learner_is_killed_restarts_itself_into_the_same_run(async_run, digits_app, tmp_path):
    """run.max_restarts (default 3): the learner SIGKILLed after the step-3 checkpoint, the run rebuilds its
    runtime, restores the checkpoint (rollouts in flight with the weights they were launched with) and redoes
    the lost steps: it ends as the run nobody killed, bit for bit, and recoveries.jsonl says what it cost."""
    run = tmp_path / "killed"
    thread, out = train_in_thread(run, ASYNC)
    wait_for(lambda: steps_logged(run) >= 4, "step 4 (after the step-3 checkpoint)")
    os.kill(actor_pid(run, "learner_0"), signal.SIGKILL)
    thread.join(timeout=600)
    assert "error" not in out, out
    assert out["result"].steps_done == 6 and not out["result"].interrupted
    step3 = run / "checkpoints" / "step_3"
    assert (step3 / "rollout_policy_v2.safetensors").exists()  # step 4's rollout was launched with version 2
    assert computed_metrics(read_metrics(run)) == computed_metrics(read_metrics(async_run.run_dir))  # bitwise
    (recovery,) = read_recoveries(run)
    assert recovery["restart"] == 1 and recovery["resumed_from_step"] == 3 and recovery["failed_step"] >= 4
    assert recovery["steps_redone"] == recovery["failed_step"] - 3 and recovery["recovery_s"] > 0
    assert "the learner died during step" in recovery["cause"]


def test_pipelined_actors_split_the_cores_unless_told_otherwise():
    from steadyrl.services.config import load_config
    from steadyrl.services.runtime.actors import torch_threads

    assert torch_threads(load_config(SMOKE), cores=16) == 16  # phases one after another: every core each
    assert torch_threads(load_config(SMOKE, ["learner.max_staleness=1"]), cores=16) == 8
    assert torch_threads(load_config(SMOKE, ["learner.max_staleness=1"]), cores=1) == 1
    assert torch_threads(load_config(SMOKE, ["learner.max_staleness=1", "ray.torch_threads=3"]), cores=16) == 3
