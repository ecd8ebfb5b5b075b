"""The job entrypoint joins a running cluster through $RAY_ADDRESS (as under `ray job submit`)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from services.report import read_metrics

ROOT = Path(__file__).resolve().parents[1]


def test_job_runs_on_a_running_cluster_and_leaves_it_up(ray_cluster, serve_port, tmp_path):
    from ray import serve

    address = ray_cluster.get_runtime_context().gcs_address
    run = tmp_path / "run"
    env = {**os.environ, "RAY_ADDRESS": address}
    proc = subprocess.run(
        [sys.executable, "-m", "services.job", "configs/smoke.yaml", f"run.run_dir={run}", "run.steps=2",
         "run.eval_every=2", "run.checkpoint_every=2", "run.eval_samples_per_class=4"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert (run / "checkpoints" / "step_2" / "policy.safetensors").exists()
    # it used the cluster's Serve (same HTTP port) and left Serve and the cluster running
    assert f":{serve_port}/" in (run / "endpoints.json").read_text()
    assert ray_cluster.is_initialized() and serve.status().proxies
