"""`steadyrl serve-reward` on its own: a user's reward endpoint on 127.0.0.1, stopped by Ctrl-C."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import torch

from steadyrl.rollout.digits import digit_splits, load_digits_tensors

ROOT = Path(__file__).resolve().parents[1]


def _default_sigint() -> None:
    """A shell's background jobs inherit SIGINT as ignored; give the child a terminal's default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_serve_reward_command_serves_scores_over_http_until_ctrl_c():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen([sys.executable, "-m", "steadyrl.services.cli", "serve-reward", "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, env=env,
                            text=True, preexec_fn=_default_sigint)
    try:
        url, seen, deadline = None, [], time.time() + 240
        while url is None and time.time() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "".join(seen)
            seen.append(line)
            m = re.search(r"POST (http://127\.0\.0\.1:\d+/reward)/score", line)
            url = m.group(1) if m else None
        assert url, "".join(seen)
        images, labels = load_digits_tensors()
        idx = torch.as_tensor(digit_splits().test[:10])
        resp = httpx.post(f"{url}/score", json={"samples": images[idx].tolist(), "cond": labels[idx].tolist()},
                          timeout=60)
        assert resp.status_code == 200, resp.text
        assert sum(resp.json()["monitors"]["gold_correct"]) >= 9
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0
