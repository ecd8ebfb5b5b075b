"""One loop, two runtimes: the local runtime (one process, no Ray or Serve) computes the same run as the Ray one."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
from steadyrl.services.controller import train
from steadyrl.services.report import read_metrics
from tests.helpers import SMOKE_SHORT, computed_metrics


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
