"""A role no live node could ever host is an error naming the role and its settings, before any actor or placement
group waits for it: checked against node descriptions, against the suite's real one-node Ray, and through
`steadyrl serve-reward` (whose replicas Serve would otherwise retry for as long as it runs)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from steadyrl.services.config import CONFIG_DIR, ConfigError, RolePlacement, ServeConfig, load_config
from steadyrl.services.runtime.node_fit import RoleUnplaceable, check_roles_fit, role_demand, training_demands
from steadyrl.services.serving import replica_gpus

ROOT = Path(__file__).resolve().parents[1]


def node(cpus: float, labels: dict[str, str] | None = None, alive: bool = True, **resources: float) -> dict:
    """A node as `ray.nodes()` describes it."""
    return {"Alive": alive, "NodeManagerAddress": "127.0.0.1", "Resources": {"CPU": cpus, "memory": 1e9,
            "node:127.0.0.1": 1.0, **resources}, "Labels": {"ray.io/node-id": "x", **(labels or {})}}


ROLLOUT = role_demand("rollout workers", "ray.roles.rollout", 0.5, 0, RolePlacement(labels={"role": "rollout"}))
LEARNER = role_demand("learner ranks", "ray.roles.learner", 0.5, 1, RolePlacement(resources={"learner_node": 1}))


def test_each_role_fits_where_one_node_has_its_labels_and_every_resource_it_asks():
    nodes = [node(2, {"role": "rollout"}), node(4, learner_node=1, GPU=1)]
    check_roles_fit([ROLLOUT, LEARNER], nodes)
    # one node must have all of it: labels on one, resources on another do not add up
    assert not LEARNER.fits(node(4, learner_node=1)) and not LEARNER.fits(node(4, GPU=8))
    assert not ROLLOUT.fits(node(2, {"role": "learner"})) and not ROLLOUT.fits(node(0.25, {"role": "rollout"}))


def test_a_role_no_live_node_fits_is_named_with_its_settings_and_what_the_nodes_offer():
    nodes = [node(2, {"role": "rollout"}, alive=False), node(4, learner_node=1)]
    with pytest.raises(RoleUnplaceable) as err:
        check_roles_fit([ROLLOUT, LEARNER], nodes)
    message = str(err.value)
    assert "the rollout workers (ray.roles.rollout) need a node with {CPU=0.5} and labels {'role': 'rollout'}" \
        in message  # the only such node is dead
    assert "the learner ranks (ray.roles.learner) need a node with {CPU=0.5, GPU=1, learner_node=1}" in message
    assert "node 127.0.0.1: {CPU=4, learner_node=1}" in message  # Ray's own markers left out
    assert "ray.check_nodes=false" in message
    assert isinstance(err.value, ConfigError)  # the CLI prints it as it prints a bad setting


def test_a_reward_replica_on_cuda_asks_its_gpu_share_which_this_machines_ray_does_not_have(ray_cluster):
    on_cuda = SimpleNamespace(members=[SimpleNamespace(device="cpu")], monitors=[SimpleNamespace(device="cuda:1")])
    on_cpu = SimpleNamespace(members=[SimpleNamespace(device="cpu")], monitors=[])
    assert replica_gpus(on_cuda, ServeConfig(replica_gpus=0.25)) == 0.25
    assert replica_gpus(on_cpu, ServeConfig(replica_gpus=0.25)) == 0.0
    cfg = load_config(CONFIG_DIR / "smoke.yaml")
    check_roles_fit(training_demands(cfg))  # the real one-node Ray hosts the default job
    gpu = role_demand("reward replicas", "serve.replica_gpus", 0.1, 0.25, RolePlacement())
    with pytest.raises(RoleUnplaceable, match=r"reward replicas \(serve.replica_gpus\) need a node with "
                                              r"\{CPU=0.1, GPU=0.25\}"):
        check_roles_fit([gpu])


def test_serve_reward_with_a_label_no_node_has_exits_naming_it_instead_of_retrying_replicas():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "steadyrl.services.driver.cli", "serve-reward", "--port", "0",
                           "ray.roles.reward.labels={steadyrl.io/role: reward}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert "reward replicas (serve.replica_cpus, serve.replica_gpus, ray.roles.reward)" in output
    assert "labels {'steadyrl.io/role': 'reward'}" in output and "Traceback" not in output
