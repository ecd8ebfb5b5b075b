"""Exact resume: a run killed with SIGKILL after its step-3 checkpoint and resumed with `--resume` logs the same
metrics and ends with the same parameters, reference, objective state and RNG as the run that went straight
through; and a resume refuses overrides that would change what the run computes."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
from steadyrl.services.driver.controller import train
from steadyrl.services.driver.resume import RESUMES_LOG, check_resume, record_resume
from steadyrl.services.run_folder.metrics import read_metrics
from tests.helpers import SMOKE_SHORT as RUN, computed_metrics

ROOT = Path(__file__).resolve().parents[1]
SMOKE = CONFIG_DIR / "smoke.yaml"

def test_a_resume_may_change_where_and_how_long_but_not_what_the_run_computes(tmp_path):
    saved = load_config(SMOKE)
    safe = load_config(SMOKE, ["run.steps=40", "serve.port=8123", "ray.num_cpus=4", "run.progress=true"])
    assert set(check_resume(saved, safe, from_step=30)) == {"run.steps", "serve.port", "ray.num_cpus", "run.progress"}
    for override, field in [("objective.eps_clip=0.001", "objective.eps_clip"), ("run.seed=7", "run.seed"),
                            ("ray.rollout_workers=2", "ray.rollout_workers"), ("learner.lr=0.001", "learner.lr")]:
        with pytest.raises(ConfigError, match=rf"{field}: .* -> .*--allow-changes"):
            check_resume(saved, load_config(SMOKE, [override]), from_step=10)
        assert field in check_resume(saved, load_config(SMOKE, [override]), from_step=10, allow_changes=True)
    with pytest.raises(ConfigError, match=r"run.steps=30: the latest checkpoint is already at step 30"):
        check_resume(saved, saved, from_step=30)
    changes = check_resume(saved, load_config(SMOKE, ["run.seed=7", "run.steps=50"]), 30, allow_changes=True)
    record_resume(tmp_path, 30, changes)
    entry = json.loads((tmp_path / RESUMES_LOG).read_text())
    assert entry["from_step"] == 30 and entry["meaning_changed"] == ["run.seed"]
    assert entry["changes"]["run.steps"] == {"saved": 30, "resumed": 50}


def _kill_after_checkpoint(run: Path, address: str, step: int) -> None:
    """Run the job as its own driver process on the session's cluster and SIGKILL it once the step's
    checkpoint is written (it is then in the middle of the next step)."""
    env = {**os.environ, "RAY_ADDRESS": address}
    proc = subprocess.Popen([sys.executable, "-m", "steadyrl.services.driver.job", str(SMOKE), f"run.run_dir={run}", *RUN],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    pointer = run / "checkpoints" / "latest"
    try:
        deadline = time.time() + 400
        while not (pointer.exists() and pointer.read_text().strip() == f"step_{step}"):
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            assert time.time() < deadline, "no checkpoint within the deadline"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGKILL


def test_killed_and_resumed_run_equals_the_run_that_went_straight_through(ray_cluster, smoke_straight, tmp_path):
    straight = smoke_straight
    killed = tmp_path / "killed"
    _kill_after_checkpoint(killed, ray_cluster.get_runtime_context().gcs_address, step=3)
    assert not (killed / "checkpoints" / "step_6").exists()
    resumed = train(resume_dir=killed)
    assert resumed.steps_done == 6 and not resumed.interrupted

    a, b = read_metrics(straight.run_dir), read_metrics(killed)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert computed_metrics(a) == computed_metrics(b)  # bitwise: floats written by json round-trip exactly
    evals = [json.loads((d / "evals.json").read_text()) for d in (straight.run_dir, killed)]
    assert [(e["step"], e["held_out"], e["proxy_mean"]) for e in evals[0]] == \
           [(e["step"], e["held_out"], e["proxy_mean"]) for e in evals[1]]
    for name in ("policy.safetensors", "reference.safetensors"):
        p, q = (load_file(str(d / "checkpoints" / "step_6" / name)) for d in (straight.run_dir, killed))
        assert p.keys() == q.keys()
        assert all(torch.equal(p[k], q[k]) for k in p), name
    s, t = (torch.load(d / "checkpoints" / "step_6" / "learner_state.pt", weights_only=True)
            for d in (straight.run_dir, killed))
    assert torch.equal(s["generator"], t["generator"]) and s["updates"] == t["updates"] > 0
    assert s["objective_state"] == t["objective_state"]
    assert json.loads((killed / RESUMES_LOG).read_text())["from_step"] == 3
