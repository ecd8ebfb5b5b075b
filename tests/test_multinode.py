"""A real multi-node Ray cluster on this machine: a head and three worker raylets on 127.0.0.1, each with its own
object store, labelled by role. `ray.roles` puts the rollout workers, the learner ranks and the reward replicas on
their own nodes; batches and weights then cross between object stores, and the run computes what one node does,
bit for bit. Nothing listens beyond loopback. Last, a run loses each role's node (its raylet and every worker on
it) and still ends as the undisturbed run."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from steadyrl.services.run_folder.metrics import read_metrics
from steadyrl.services.run_folder.recoveries import read_recoveries
from tests.helpers import ROLE_LABEL as LABEL
from tests.helpers import SMOKE_SHORT, computed_metrics, loopback_cluster, on_loopback, wait_for

ROOT = Path(__file__).resolve().parents[1]
#: the rollout workers and the reward replicas by node label, the learner ranks by a custom resource
ROLES = [f"ray.roles.rollout.labels={{'{LABEL}': rollout}}", f"ray.roles.reward.labels={{'{LABEL}': reward}}",
         "ray.roles.learner.resources={learner_node: 1}"]
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
#: each role's node also has a custom resource of its own (the node-loss test places the roles by these)
ROLE_RESOURCES = {"rollout": {"rollout_node": 1}, "learner": {"learner_node": 2}, "reward": {"reward_node": 1}}


@pytest.fixture(scope="module")
def cluster():
    """Head and one node per role (`helpers.loopback_cluster`), labelled and with a custom resource each."""
    cluster, nodes = loopback_cluster(ROLE_RESOURCES)
    yield cluster, nodes
    cluster.shutdown()


def train_on(cluster, run_dir: Path, *overrides: str, wait: bool = True):
    """`steadyrl train` joining the cluster (its own process: this one holds the suite's one-node Ray); the
    finished process, or (wait=False) the running one."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "steadyrl.services.driver.cli", "train", "configs/smoke.yaml",
               f"ray.address={cluster.address}", f"run.run_dir={run_dir}", *SMOKE_SHORT, *ROLES, *overrides]
    if not wait:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)


def processes_of(node) -> list[psutil.Process]:
    """The node's raylet and every process it started (its workers: actors, Serve replicas)."""
    raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
    return [raylet, *raylet.children(recursive=True)]


def same_run(a: Path, b: Path, checkpoints: tuple[int, ...] = (3, 6)) -> None:
    assert computed_metrics(read_metrics(a)) == computed_metrics(read_metrics(b))
    assert json.loads((a / "evals.json").read_text()) == json.loads((b / "evals.json").read_text())
    for step in checkpoints:
        mine, theirs = (load_file(str(d / "checkpoints" / f"step_{step}" / "policy.safetensors")) for d in (a, b))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def listening(node) -> list[tuple[str, str]]:
    """(command, address) of every socket the node's processes listen on."""
    return [(" ".join(p.cmdline())[:60], c.laddr.ip) for p in processes_of(node)
            for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]


def test_roles_run_on_their_nodes_listen_on_loopback_and_the_run_equals_one_nodes_bitwise(cluster, smoke_straight,
                                                                                         tmp_path):
    """While the run scores its first batch: the reward replicas live on the reward node, and every server of
    every node (raylets, object stores, GCS, workers) listens on 127.0.0.1; the one exception, as on one node
    (tests/test_cli_serve_reward.py), is the gRPC server Serve binds to [::] in each replica itself."""
    cluster, nodes = cluster
    run = train_on(cluster, tmp_path / "run", wait=False)
    try:
        wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").exists() or run.poll() is not None, "the first step")
        replicas = [p for p in processes_of(nodes["reward"]) if "ServeReplica" in " ".join(p.cmdline())]
        sockets = [s for node in (cluster.head_node, *nodes.values()) for s in listening(node)]
    finally:
        output, _ = run.communicate(timeout=900)
    assert run.returncode == 0, output[-4000:]
    assert replicas, "no reward replica on the reward node"
    assert len(sockets) >= 12, sockets
    assert all(cmd.startswith("ray::ServeReplica") for cmd, ip in sockets if ip not in LOOPBACK), sockets
    actors = json.loads((tmp_path / "run" / "actors.json").read_text())["actors"]
    assert {a["role"]: a["node_id"] for a in actors.values()} == \
        {"rollout": nodes["rollout"].node_id, "learner": nodes["learner"].node_id}
    same_run(tmp_path / "run", smoke_straight.run_dir)
    # every batch crosses from the rollout node's object store to the learner's, every policy the other way
    for row in read_metrics(tmp_path / "run"):
        assert row["handoff/cross_node_batch_bytes"] == row["handoff/batch_bytes"] > 0, row
        assert row["handoff/cross_node_weight_bytes"] > 0, row
        assert row["handoff/driver_tensor_bytes"] < row["handoff/batch_bytes"] / 100, row  # summaries only


def test_two_learner_ranks_on_their_node_train_as_two_ranks_on_one_node_bitwise(cluster, ray_cluster, serve_port,
                                                                            tmp_path):
    """learner.ranks=2 (both on the learner node, rendezvousing there) against the same on the suite's one-node
    Ray: the same metrics, evaluations and weights."""
    from steadyrl.services.config import CONFIG_DIR
    from steadyrl.services.driver.controller import train
    from tests.helpers import ensure_digits_app

    cluster, nodes = cluster
    short = ["learner.ranks=2", "run.steps=2", "run.checkpoint_every=2", "run.eval_every=2"]
    done = train_on(cluster, tmp_path / "cluster", *short)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    actors = json.loads((tmp_path / "cluster" / "actors.json").read_text())["actors"]
    assert sorted(a["node_id"] for a in actors.values() if a["role"] == "learner") == [nodes["learner"].node_id] * 2
    ensure_digits_app()
    one_node = train(CONFIG_DIR / "smoke.yaml", [f"run.run_dir={tmp_path / 'one'}", *SMOKE_SHORT, *short])
    same_run(tmp_path / "cluster", one_node.run_dir, checkpoints=(2,))


def test_a_role_no_node_can_host_fails_naming_the_role_and_its_labels_before_anything_starts(cluster, tmp_path):
    cluster, _ = cluster
    done = train_on(cluster, tmp_path / "run", "ray.roles.learner.labels={steadyrl.io/role: gpu}")
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "learner ranks (ray.actor_cpus, ray.learner_gpus, ray.roles.learner)" in output
    assert "labels {'steadyrl.io/role': 'gpu'}" in output and "labels {'steadyrl.io/role': 'rollout'}" in output
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize("override, message", [
    ("ray.roles.reward.resources={CPU: 1}", "Ray's own resources"),
    ("ray.roles.learner.resources={learner_node: 0}", "amounts must be > 0"),
    ("ray.roles.rewards.labels={a: b}", "ray.roles.rewards"),
])
def test_a_role_setting_ray_cannot_take_is_a_config_error_naming_it(override, message):
    from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config

    with pytest.raises(ConfigError, match=message):
        load_config(CONFIG_DIR / "smoke.yaml", [override])


#: the roles by the custom resources of their nodes (a spare node can carry all three; a label has one value)
BY_RESOURCES = ["ray.roles.rollout.resources={rollout_node: 1}", "ray.roles.learner.resources={learner_node: 1}",
                "ray.roles.reward.resources={reward_node: 0.01}"]


def steps_logged(run: Path) -> int:
    return len(read_metrics(run)) if (run / "metrics.jsonl").exists() else 0


def test_a_run_that_loses_its_rollout_reward_and_learner_nodes_ends_as_the_undisturbed_run(cluster, smoke_straight,
                                                                                          tmp_path):
    """Last in this module: it removes the role nodes. The roles placed by custom resources, which a spare
    node added once the run is placed also has: the rollout worker comes back there and its call is re-issued,
    Serve replaces the reward replica there and scoring retries, and the lost learner's run restarts itself
    from the step-3 checkpoint there (run.max_restarts). The run ends as the run on one node nobody disturbed,
    bit for bit, and says what the losses cost (recoveries.jsonl)."""
    cluster, nodes = cluster
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen(
        [sys.executable, "-m", "steadyrl.services.driver.cli", "train", "configs/smoke.yaml",
         f"ray.address={cluster.address}", f"run.run_dir={run}", *SMOKE_SHORT, *BY_RESOURCES],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    losses: dict[str, float] = {}
    try:
        wait_for(lambda: steps_logged(run) >= 1 or driver.poll() is not None, "the first step", 600)
        with on_loopback():  # capacity for every role, now that each is placed on its own node
            cluster.add_node(num_cpus=2, node_ip_address="127.0.0.1",
                             resources={k: v for r in ROLE_RESOURCES.values() for k, v in r.items()})
            cluster.wait_for_nodes()
        for role, after_step in (("rollout", 1), ("reward", 2), ("learner", 4)):
            wait_for(lambda: steps_logged(run) >= after_step or driver.poll() is not None, f"step {after_step}", 600)
            cluster.remove_node(nodes[role], allow_graceful=False)
            losses[role] = time.time()
        output, _ = driver.communicate(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, output[-5000:]
    assert set(losses) == {"rollout", "reward", "learner"}
    rows = read_metrics(run)
    same_run(run, smoke_straight.run_dir)  # metrics, evaluations and checkpointed weights, bitwise
    assert [r["rollout/samples"] for r in rows] == [40.0] * 6 and [r["policy/samples"] for r in rows] == [40.0] * 6
    assert sum(r["faults/rollout_restarts"] for r in rows) >= 1  # the lost rollout worker, re-issued
    (recovery,) = read_recoveries(run)  # only the learner's loss needed a restart from the checkpoint
    assert recovery["resumed_from_step"] == 3 and recovery["failed_step"] >= 5 and "learner" in recovery["cause"]
    assert recovery["steps_redone"] == recovery["failed_step"] - 3 and recovery["recovery_s"] > 0
    actors = json.loads((run / "actors.json").read_text())["actors"]
    assert all(a["node_id"] not in {n.node_id for n in nodes.values()} for a in actors.values())  # on the spare
    print("restart:", recovery, "rollout restarts:", sum(r["faults/rollout_restarts"] for r in rows),
          "reward retries:", sum(r["faults/reward_retries"] for r in rows))
