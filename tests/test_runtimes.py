"""One loop, two runtimes: the local runtime (one process, no Ray or Serve) computes the same run as the Ray one."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
from steadyrl.services.driver.controller import train
from steadyrl.services.run_folder.metrics import read_metrics
from tests.helpers import SMOKE_SHORT, computed_metrics, train_local


def test_local_runtime_gives_the_ray_runs_metrics_evaluations_and_weights_bitwise(smoke_straight, tmp_path):
    """The same short digits run (one rollout worker, same seeds) through `steadyrl train --local` and through
    Ray actors, the Serve ensemble and a DeepSpeed actor: every computed metric, every evaluation and the
    checkpointed weights are equal, bit for bit."""
    local = train(CONFIG_DIR / "smoke.yaml", [f"run.run_dir={tmp_path / 'local'}", "run.runtime=local", *SMOKE_SHORT])
    ray_dir = smoke_straight.run_dir
    assert local.steps_done == smoke_straight.steps_done == 6
    assert computed_metrics(read_metrics(local.run_dir)) == computed_metrics(read_metrics(ray_dir))
    assert json.loads((local.run_dir / "evals.json").read_text()) == json.loads((ray_dir / "evals.json").read_text())
    for step in (3, 6):
        mine = load_file(str(local.run_dir / "checkpoints" / f"step_{step}" / "policy.safetensors"))
        theirs = load_file(str(ray_dir / "checkpoints" / f"step_{step}" / "policy.safetensors"))
        assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    # the local run leaves no Ray behind it and wrote no reward endpoint
    assert not (local.run_dir / "endpoints.json").exists()


def test_local_runtime_refuses_more_than_one_learner_rank():
    with pytest.raises(ConfigError, match=r"learner.ranks=2: run.runtime=local runs one learner rank"):
        load_config(CONFIG_DIR / "smoke.yaml", ["run.runtime=local", "learner.ranks=2"])


def test_a_pipelined_local_run_resumes_to_the_same_run(tmp_path):
    """learner.max_staleness=1 on the local runtime: the step-1 checkpoint records step 2's rollouts in flight
    with the base policy (version 0); resuming from it relaunches them with those weights, and the run's metrics
    equal the straight run's bitwise."""
    import shutil

    overrides = ["run.steps=3", "run.checkpoint_every=1", "learner.max_staleness=1", "sampler.group_size=4",
                 "testbed.eval_samples_per_class=2"]
    straight, rows = train_local(CONFIG_DIR / "smoke.yaml", tmp_path / "straight", overrides)
    state = json.loads((straight.run_dir / "checkpoints" / "step_1" / "controller.json").read_text())
    assert state["pending"] == {"1": 0} and [r["async/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
    resumed = tmp_path / "resumed"
    shutil.copytree(straight.run_dir, resumed)
    (resumed / "checkpoints" / "latest").write_text("step_1")  # as if it had died after step 1
    result = train(resume_dir=resumed)
    assert result.steps_done == 3
    assert computed_metrics(read_metrics(resumed)) == computed_metrics(rows)
