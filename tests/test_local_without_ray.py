"""The local runtime needs no Ray: on a node where Ray, Serve and fastapi are not installed (an air-gapped GPU node
whose wheels must fit 64 MiB, Ray's alone being larger), `steadyrl train --local` trains and the Ray commands say
what they need. "Not installed" is made real in a subprocess: a sitecustomize puts None in `sys.modules` for each
blocked package, which is how Python itself marks a module that cannot be imported (`import ray` raises
ModuleNotFoundError, `importlib.util.find_spec("ray")` answers None)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("ray", "fastapi", "starlette", "uvicorn")
STEADYRL = [sys.executable, "-m", "steadyrl.services.driver.cli"]


@pytest.fixture
def without_ray(tmp_path: Path) -> dict[str, str]:
    """An environment whose Python cannot import Ray, Serve or fastapi."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in BLOCKED))
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


def test_the_blocker_really_makes_ray_unimportable(without_ray):
    code = "import importlib.util as u; print(u.find_spec('ray')); import ray"
    out = subprocess.run([sys.executable, "-c", code], env=without_ray, capture_output=True, text=True)
    assert out.returncode != 0 and out.stdout.split() == ["None"] and "ModuleNotFoundError" in out.stderr


@pytest.mark.slow
def test_a_local_run_trains_where_ray_cannot_be_imported(tmp_path, without_ray):
    run = tmp_path / "run"
    out = subprocess.run([*STEADYRL, "train", "--local", str(ROOT / "configs/digits-grpo.yaml"), "run.steps=2",
                          f"run.run_dir={run}", "run.progress=false"],
                         env=without_ray, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["policy/samples"] > 0 and r["policy/grad_norm"] > 0 for r in rows)
    assert (run / "checkpoints" / "latest").exists()


@pytest.mark.parametrize("command, needs", [
    (["train", str(ROOT / "configs/digits-grpo.yaml")], "run.runtime=ray needs Ray"),
    (["serve-reward"], "serve-reward (a Ray Serve application) needs Ray"),
])
def test_a_ray_command_without_ray_says_so_and_starts_nothing(tmp_path, without_ray, command, needs):
    run = tmp_path / "run"
    out = subprocess.run([*STEADYRL, *command, *([f"run.run_dir={run}"] if command[0] == "train" else [])],
                         env=without_ray, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 2, text
    assert needs in text and "pip install 'ray[serve]'" in text and "Traceback" not in text
    assert len(text.strip().splitlines()) <= 3, text
    assert not run.exists()  # nothing written: the check comes before the run folder


def test_fused_adam_without_a_learner_gpu_is_refused_when_the_config_loads():
    from steadyrl.services.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"learner.fused_adam=true .*ray.learner_gpus > 0"):
        load_config(ROOT / "configs/digits-grpo.yaml", ["learner.fused_adam=true"])
    cfg = load_config(ROOT / "configs/digits-grpo.yaml", ["learner.fused_adam=true", "ray.learner_gpus=1"])
    from steadyrl.trainer.deepspeed_config import deepspeed_config

    assert deepspeed_config(cfg.learner, client_optimizer=False)["optimizer"]["params"]["torch_adam"] is False
    assert deepspeed_config(load_config(ROOT / "configs/digits-grpo.yaml").learner, False)["optimizer"]["params"][
        "torch_adam"] is True


@pytest.mark.slow
def test_gpu_check_runs_a_tiny_pipeline_where_ray_cannot_be_imported(tmp_path, without_ray):
    out = tmp_path / "gpu_check.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_check.py"), "--tiny", "sd3", "--steps", "2",
                           "--out", str(out)], env=without_ray, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    [result] = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["steps"] == 2 and result["finite"] and result["samples_per_s"] > 0


def test_resuming_a_ray_run_without_ray_records_nothing(tmp_path, without_ray):
    run = tmp_path / "run"
    run.mkdir()
    from steadyrl.services.config import dump_config, load_config

    (run / "config.yaml").write_text(dump_config(load_config(ROOT / "configs/digits-grpo.yaml",
                                                             [f"run.run_dir={run}"])))
    out = subprocess.run([*STEADYRL, "train", "--resume", str(run)], env=without_ray, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "run.runtime=ray needs Ray" in out.stdout + out.stderr
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml"]  # no resumes.jsonl, no checkpoint touched
