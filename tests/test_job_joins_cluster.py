"""The job entrypoint joins a running cluster through $RAY_ADDRESS (as under `ray job submit`), and the
installed package cannot be shadowed by a user's own `trainer`, `services`, `reward` or `rollout`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from steadyrl.services.run_folder.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
SHADOWS = ("trainer.py", "reward.py", "services/__init__.py", "rollout/__init__.py")


def clashing_project(tmp_path: Path) -> Path:
    """A user's project whose modules share the repository's folder names; importing any of them fails loudly."""
    project = tmp_path / "user_project"
    for name in SHADOWS:
        path = project / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"raise ImportError('the user project\\'s {name} was imported instead of steadyrl')\n")
    return project


def test_cli_help_runs_from_a_project_with_its_own_trainer_and_services(tmp_path):
    project = clashing_project(tmp_path)
    steadyrl = Path(sys.executable).parent / "steadyrl"
    for cmd in ([str(steadyrl), "--help"], [sys.executable, "-m", "steadyrl.services.driver.cli", "train", "--help"]):
        proc = subprocess.run(cmd, cwd=project, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "steadyrl" in proc.stdout or "resume" in proc.stdout


def test_job_runs_on_a_running_cluster_from_a_clashing_project_and_leaves_it_up(ray_cluster, serve_port, tmp_path):
    """`python -m steadyrl.services.driver.job` puts the user's directory first on sys.path, and the cluster's actors run
    there too: every import of the run (driver, rollout worker, learner, Serve replicas) is steadyrl's own."""
    from ray import serve

    address = ray_cluster.get_runtime_context().gcs_address
    run = tmp_path / "run"
    # what `ray job submit --runtime-env-json '{"env_vars": ...}'` hands the driver: the run must not set them again
    job_config = json.dumps({"runtime_env": {"env_vars": {"HF_HUB_OFFLINE": "1"}}})
    env = {**os.environ, "RAY_ADDRESS": address, "RAY_JOB_CONFIG_JSON_ENV_VAR": job_config}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(
        [sys.executable, "-m", "steadyrl.services.driver.job", str(ROOT / "configs/smoke.yaml"), f"run.run_dir={run}",
         "run.steps=2", "run.eval_every=2", "run.checkpoint_every=2", "testbed.eval_samples_per_class=4"],
        cwd=clashing_project(tmp_path), env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert (run / "checkpoints" / "step_2" / "policy.safetensors").exists()
    # it used the cluster's Serve (same HTTP port) and left Serve and the cluster running
    assert f":{serve_port}/" in (run / "endpoints.json").read_text()
    assert ray_cluster.is_initialized() and serve.status().proxies


def test_no_module_imports_the_folders_by_their_bare_names():
    """Every import of the repository's own code goes through `steadyrl.`: a bare `import trainer` would pick up
    whatever `trainer` comes first on the user's sys.path."""
    import ast

    bare = {"rollout", "reward", "trainer", "services"}
    offenders = []
    for path in sorted(ROOT.glob("*/**/*.py")):
        if ".venv" in path.parts or "site-packages" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in bare]
    assert not offenders, offenders
