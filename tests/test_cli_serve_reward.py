"""`steadyrl serve-reward` on its own: a user's reward endpoint on 127.0.0.1, behind a bearer token, stopped by
Ctrl-C. One server process for the module (it starts its own Ray); the last test stops it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from typer.testing import CliRunner

from steadyrl.rollout.digits import digit_splits, load_digits_tensors

ROOT = Path(__file__).resolve().parents[1]
TOKEN_ENV, TOKEN = "STEADYRL_CLI_TEST_TOKEN", "cli-s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _default_sigint() -> None:
    """A shell's background jobs inherit SIGINT as ignored; give the child a terminal's default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def server():
    """`steadyrl serve-reward --port 0 serve.auth_token_env=...` (no --host), until it prints its routes."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(PYTHONUNBUFFERED="1", **{TOKEN_ENV: TOKEN})
    proc = subprocess.Popen([sys.executable, "-m", "steadyrl.services.cli", "serve-reward", "--port", "0",
                             f"serve.auth_token_env={TOKEN_ENV}"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, env=env, text=True,
                            preexec_fn=_default_sigint)
    try:
        seen, deadline = [], time.time() + 240
        while not any("docs http" in line for line in seen) and time.time() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(seen)
            seen.append(line)
        m = re.search(r"POST (http://127\.0\.0\.1:(\d+)/reward)/v1/score", "".join(seen))
        assert m, "".join(seen)
        yield {"proc": proc, "url": m.group(1), "port": int(m.group(2)), "output": "".join(seen)}
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_serve_reward_binds_loopback_only_by_default(server):
    listening = [c.laddr.ip for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == server["port"]]
    assert listening and set(listening) == {"127.0.0.1"}, listening
    assert "this machine only" in server["output"]


def test_serve_reward_prints_its_routes_and_never_the_token(server):
    out, url = server["output"], server["url"]
    for route in (f"POST {url}/v1/score", f"GET  {url}/v1/models", f"GET  {url}/healthz", f"docs {url}/docs"):
        assert route in out, out
    assert f"${TOKEN_ENV}" in out and "at most 256 per request" in out
    assert TOKEN not in out


def test_missing_bearer_token_is_a_401_and_the_token_scores(server):
    url = server["url"]
    images, labels = load_digits_tensors()
    idx = torch.as_tensor(digit_splits().test[:10])
    body = {"samples": [{"image": img.tolist(), "digit": int(y)} for img, y in zip(images[idx], labels[idx])]}
    assert httpx.post(f"{url}/v1/score", json=body, timeout=60).status_code == 401
    assert httpx.post(f"{url}/v1/score", json=body, headers={"Authorization": "Bearer nope"}, timeout=60).status_code == 401
    resp = httpx.post(f"{url}/v1/score", json=body, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    assert sum(resp.json()["monitors"]["gold_correct"]) >= 9
    assert httpx.get(f"{url}/healthz", timeout=60).status_code == 200  # probes need no token


def test_ctrl_c_stops_the_server_cleanly(server):
    proc = server["proc"]
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(timeout=90)
    assert proc.returncode == 0


def test_an_unset_token_variable_fails_before_ray_starts():
    from steadyrl.services.cli import app

    assert "STEADYRL_NO_SUCH_TOKEN" not in os.environ
    result = CliRunner().invoke(app, ["serve-reward", "serve.auth_token_env=STEADYRL_NO_SUCH_TOKEN"])
    assert result.exit_code == 2 and "serve.auth_token_env='STEADYRL_NO_SUCH_TOKEN'" in result.output
