"""Shared fixtures: one real local Ray and one real Serve (HTTP on 127.0.0.1) for the whole run."""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

# tests/vllm_backend really run vLLM: collected where it is installed (`make test-vllm` builds that venv), never skipped
collect_ignore = [] if importlib.util.find_spec("vllm") is not None else ["vllm_backend"]


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The test process's own torch work (tiny models) runs on one thread: with Ray actors busy on the
    other core, two OpenMP threads per process oversubscribe a 2-core machine and run ~20x slower.
    Actors set their own thread count (`ray.torch_threads`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session", autouse=True)
def prewarm_caches():
    """Under STEADYRL_TEST_PREWARM=1 (`make test`), tests/prewarm.py builds the presets' bases and DeepSpeed's CPU
    op at nice 10 beside the tests. At the end it is interrupted if still at work (SIGINT: its partial builds
    are removed, as after a crash)."""
    import signal
    import subprocess
    import tempfile
    import warnings

    if os.environ.get("STEADYRL_TEST_PREWARM") != "1":
        yield
        return
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.prewarm"], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=lambda: os.nice(10))
        yield
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        elif proc.returncode != 0:  # the tests built what they needed themselves; say why it did not
            log.seek(0)
            warnings.warn(f"tests/prewarm.py failed ({proc.returncode}): {log.read().decode()[-2000:]}")


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from steadyrl.services.runtime.ray_session import init_ray

    started = init_ray(num_cpus=2) == "local"
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_port(ray_cluster) -> int:
    from steadyrl.services.config import ServeConfig
    from steadyrl.services.runtime.ray_session import start_serve

    _, port = start_serve(ServeConfig(port=0))
    return port


@pytest.fixture()
def digits_app(serve_port) -> None:
    from tests.helpers import ensure_digits_app

    ensure_digits_app()


@pytest.fixture()
def reward_url(serve_port, digits_app) -> str:
    """Base URL of the reward ensemble app."""
    from steadyrl.services.serving import ROUTE_PREFIX

    return f"http://127.0.0.1:{serve_port}{ROUTE_PREFIX}"


@pytest.fixture(scope="session")
def smoke_straight(ray_cluster, serve_port, tmp_path_factory):
    """configs/smoke.yaml with SMOKE_SHORT, run straight through once per session (6 steps, checkpoints at 3, 6)."""
    from steadyrl.services.config import CONFIG_DIR
    from steadyrl.services.driver.controller import train
    from tests.helpers import SMOKE_SHORT, ensure_digits_app

    ensure_digits_app()
    result = train(CONFIG_DIR / "smoke.yaml", [f"run.run_dir={tmp_path_factory.mktemp('smoke') / 'straight'}",
                                               *SMOKE_SHORT])
    assert result.steps_done == 6
    return result
