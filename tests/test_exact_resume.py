"""Exact resume: a job whose driver is killed with SIGKILL after its step-3 checkpoint, and whose same command is
run again (`run.resume=auto`, as a RayJob's retry does), logs the same metrics and ends with the same parameters,
reference, objective state and RNG as the run that went straight through; a resume refuses overrides that would
change what the run computes, and run.resume=auto a folder whose run differs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
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


def job_command(run: Path) -> list[str]:
    """The job's command, as a RayJob's entrypoint: continues its run folder when run again."""
    return [sys.executable, "-m", "steadyrl.services.driver.job", str(SMOKE), f"run.run_dir={run}", "run.resume=auto",
            *RUN]


def _kill_after_checkpoint(run: Path, address: str, step: int) -> None:
    """Run the job as its own driver process on the session's cluster and SIGKILL it once the step's
    checkpoint is written (it is then in the middle of the next step)."""
    env = {**os.environ, "RAY_ADDRESS": address}
    proc = subprocess.Popen(job_command(run), cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
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


def test_a_killed_driver_whose_command_runs_again_ends_as_the_run_that_went_straight_through(
        ray_cluster, smoke_straight, tmp_path):
    straight = smoke_straight
    killed = tmp_path / "killed"
    address = ray_cluster.get_runtime_context().gcs_address
    _kill_after_checkpoint(killed, address, step=3)
    assert not (killed / "checkpoints" / "step_6").exists()
    again = subprocess.run(job_command(killed), cwd=ROOT, env={**os.environ, "RAY_ADDRESS": address},
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert f"continuing {killed} from its step-3 checkpoint" in " ".join(again.stdout.split())

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


def test_auto_resume_refuses_another_runs_folder_and_leaves_a_finished_one_as_it_is(tmp_path):
    from tests.helpers import train_local

    run = tmp_path / "run"
    short = [*RUN, "run.steps=2", "run.checkpoint_every=2", "run.eval_every=2", "run.resume=auto"]
    first, rows = train_local(SMOKE, run, short)
    assert first.steps_done == 2 and [r["step"] for r in rows] == [1, 2]
    with pytest.raises(ConfigError, match=rf"run.resume=auto: {run} holds a run whose config differs "
                                          r"\(run.seed: 0 -> 7\).*steadyrl train --resume"):
        train_local(SMOKE, run, [*short, "run.seed=7"])
    done, rows_after = train_local(SMOKE, run, short)  # the same command again: nothing left to do
    assert done.steps_done == 2 and rows_after == rows and done.final_eval == first.final_eval
    assert not (run / RESUMES_LOG).exists()
    longer, rows_longer = train_local(SMOKE, run, [*short, "run.steps=3"])  # resume-safe: continued, recorded
    assert longer.steps_done == 3 and [r["step"] for r in rows_longer] == [1, 2, 3]
    assert json.loads((run / RESUMES_LOG).read_text())["changes"] == {"run.steps": {"saved": 2, "resumed": 3}}


def test_auto_resume_starts_afresh_in_a_folder_without_a_checkpoint(tmp_path):
    from tests.helpers import train_local

    run = tmp_path / "run"
    short = [*RUN, "run.steps=2", "run.checkpoint_every=2", "run.eval_every=2", "run.resume=auto"]
    _, rows = train_local(SMOKE, run, short)
    shutil.rmtree(run / "checkpoints")  # as a driver killed after its steps' rows, before their checkpoint
    _, again = train_local(SMOKE, run, short)
    assert (run / "checkpoints" / "step_2").is_dir()
    assert computed_metrics(again) == computed_metrics(rows)  # the rows of one run, not two
    with pytest.raises(ConfigError, match="resume=auto needs run_dir"):
        load_config(SMOKE, ["run.resume=auto"])
