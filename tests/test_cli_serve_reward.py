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


def start_server(*args: str, env: dict[str, str] | None = None) -> dict:
    """`steadyrl serve-reward --port 0 ARGS` in its own session (its own local Ray), once it prints its routes."""
    full_env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    full_env.update(PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen([sys.executable, "-m", "steadyrl.services.driver.cli", "serve-reward", "--port", "0", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env=full_env, text=True, preexec_fn=_default_sigint)
    seen, deadline = [], time.time() + 240
    while not any("docs http" in line for line in seen) and time.time() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
    m = re.search(r"POST (http://127\.0\.0\.1:(\d+)/reward)/v1/score", "".join(seen))
    if not m:
        os.killpg(proc.pid, signal.SIGKILL)
        raise AssertionError("".join(seen))
    return {"proc": proc, "url": m.group(1), "port": int(m.group(2)), "output": "".join(seen)}


def started_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process under the CLI's: Ray's GCS, raylet, agents, workers and replicas."""
    return psutil.Process(proc.pid).children(recursive=True)


def assert_stops_leaving_nothing(proc: subprocess.Popen, sig: int, group: bool) -> str:
    """Send `sig` to the CLI alone or to its whole process group (a terminal's Ctrl-C); it exits 0 and every
    process it started is gone within 30 s."""
    started = started_processes(proc)
    assert len(started) >= 4, started  # Ray's processes and the replicas, as a sanity check of the listing
    (os.killpg if group else os.kill)(proc.pid, sig)
    out = proc.communicate(timeout=120)[0]
    deadline = time.time() + 30
    alive = started
    while alive and time.time() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.5)
    assert proc.returncode == 0, out[-3000:]
    assert "shutting down" in out and "Traceback" not in out and "Aborted" not in out, out[-3000:]
    assert not alive, [" ".join(p.cmdline())[:80] for p in alive]
    return out


@pytest.fixture(scope="module")
def server():
    """`steadyrl serve-reward --port 0 serve.auth_token_env=...` (no --host), until it prints its routes."""
    server = start_server(f"serve.auth_token_env={TOKEN_ENV}", env={TOKEN_ENV: TOKEN})
    try:
        yield server
    finally:
        if server["proc"].poll() is None:
            os.killpg(server["proc"].pid, signal.SIGKILL)


def test_serve_reward_and_its_ray_listen_on_loopback_only(server):
    """The REST app on 127.0.0.1 by default, and every server Ray starts (GCS, raylet, agents, Prometheus
    metrics) on loopback too (`ray.local_network`)."""
    listening = [c.laddr.ip for c in psutil.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == server["port"]]
    assert listening and set(listening) == {"127.0.0.1"}, listening
    assert "this machine only" in server["output"]
    ray_listening = {(" ".join(p.cmdline())[:60], c.laddr.ip, c.laddr.port)
                     for p in started_processes(server["proc"]) for c in p.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN}
    assert len(ray_listening) >= 5, ray_listening
    # the one exception: Ray Serve binds each replica's inter-deployment gRPC server to [::] itself
    # (ray/serve/_private/replica.py); it carries Ray's token-authentication interceptor
    open_to_network = {(cmd, ip, port) for cmd, ip, port in ray_listening
                       if ip not in {"127.0.0.1", "::ffff:127.0.0.1", "::1"}}
    assert all(cmd.startswith("ray::ServeReplica") for cmd, _, _ in open_to_network), open_to_network


def test_the_token_is_in_no_ray_process_environment(server):
    """Read before Ray starts and removed from the environment: no Ray process or replica inherits it."""
    environments = {p.pid: p.environ() for p in started_processes(server["proc"])}
    assert len(environments) >= 4
    holding = [pid for pid, env in environments.items() if TOKEN_ENV in env or TOKEN in "".join(env.values())]
    assert not holding, holding


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


def test_sigterm_to_the_cli_alone_stops_it_and_every_process_it_started(server):
    """What `kill PID` or a process manager sends: a graceful stop (it was SIGABRT, with Ray's agents left)."""
    assert_stops_leaving_nothing(server["proc"], signal.SIGTERM, group=False)


def test_ctrl_c_stops_the_server_and_every_process_it_started():
    assert_stops_leaving_nothing(start_server()["proc"], signal.SIGINT, group=True)


def test_an_unset_token_variable_fails_before_ray_starts():
    from steadyrl.services.driver.cli import app

    assert "STEADYRL_NO_SUCH_TOKEN" not in os.environ
    result = CliRunner().invoke(app, ["serve-reward", "serve.auth_token_env=STEADYRL_NO_SUCH_TOKEN"])
    assert result.exit_code == 2 and "serve.auth_token_env='STEADYRL_NO_SUCH_TOKEN'" in result.output
