"""Ctrl-C or SIGTERM on a running job: it stops, shuts Ray and Serve down (no process it started is left), and
the last checkpoint is intact."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]


def _default_sigint() -> None:
    """A shell's background jobs inherit SIGINT as ignored; give the child a terminal's default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("sig, group, status, runtime", [
    (signal.SIGINT, True, 130, "ray"),  # a terminal's Ctrl-C: the whole process group
    (signal.SIGTERM, False, 143, "ray"),  # `kill PID`, a process manager, Kubernetes: the CLI alone
    (signal.SIGTERM, False, 143, "local"),  # the one-process runtime: no Ray to replace the handler
], ids=["ctrl-c", "sigterm", "sigterm-local"])
def test_a_signal_stops_cleanly_keeps_the_last_checkpoint_and_leaves_no_process(tmp_path, sig, group, status,
                                                                                 runtime):
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, as a user's
    proc = subprocess.Popen(
        [sys.executable, "-m", "steadyrl.services.driver.job", "configs/smoke.yaml", f"run.run_dir={run}", "run.steps=500", "testbed.eval_samples_per_class=2",
         "run.checkpoint_every=2", f"run.runtime={runtime}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        preexec_fn=_default_sigint,
    )
    try:
        deadline = time.time() + 400
        while not (run / "checkpoints" / "latest").exists():
            assert proc.poll() is None, proc.communicate()[0].decode()[-3000:]
            assert time.time() < deadline, "no checkpoint within the deadline"
            time.sleep(0.5)
        url = json.loads((run / "endpoints.json").read_text())["reward"] if runtime == "ray" else None
        assert url is None or httpx.get(f"{url}/healthz", timeout=30).status_code == 200
        time.sleep(1.0)  # land the signal mid-step
        started = psutil.Process(proc.pid).children(recursive=True)  # Ray's processes, actors and replicas
        (os.killpg if group else os.kill)(proc.pid, sig)
        out = proc.communicate(timeout=120)[0].decode()
        deadline = time.time() + 30
        while started and time.time() < deadline:
            started = [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == status, out[-3000:]
    assert "interrupted after step" in out and "Traceback" not in out and "Aborted" not in out, out[-3000:]
    assert not started, [" ".join(p.cmdline())[:80] for p in started]
    ckpts = run / "checkpoints"
    latest = ckpts / (ckpts / "latest").read_text().strip()
    step = json.loads((latest / "controller.json").read_text())["step"]
    assert step >= 2 and step % 2 == 0, step
    assert len(load_file(str(latest / "policy.safetensors"))) > 10
    assert not list(ckpts.glob(".*tmp*"))
    if runtime == "ray":
        assert (latest / "engine").is_dir()
        with pytest.raises(httpx.TransportError):  # Serve's HTTP proxy went down with the job's Ray
            httpx.get(f"{url}/healthz", timeout=5)
