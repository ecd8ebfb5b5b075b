"""`ray.worker_niceness`: a local Ray started through `init_ray` runs its actors at the driver's niceness plus the
setting (Ray's own default, 15, would leave them starved by any other CPU job on the machine)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A fresh process, so its local Ray is its own (the session's `ray_cluster` would make init_ray join it instead).
CHILD = """
import json, os, sys
import ray
from steadyrl.services.config import load_config
from steadyrl.services.runtime.ray_session import init_ray

cfg = load_config(None, sys.argv[1:])
mode = init_ray(None, 1, cfg.ray.local_network, cfg.ray.worker_niceness)

@ray.remote(num_cpus=0.5)
class Probe:
    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)

try:
    actor = ray.get(Probe.remote().niceness.remote())
finally:
    ray.shutdown()
print(json.dumps({"mode": mode, "driver": os.getpriority(os.PRIO_PROCESS, 0), "actor": actor}))
"""


@pytest.mark.parametrize("setting", [None, 7])
def test_actors_of_a_local_ray_run_at_the_driver_niceness_plus_the_setting(setting):
    overrides = [] if setting is None else [f"ray.worker_niceness={setting}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_worker_niceness")}
    proc = subprocess.run([sys.executable, "-c", CHILD, *overrides], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["mode"] == "local"
    expected = 0 if setting is None else setting  # the field's default is 0
    assert seen["actor"] == min(19, seen["driver"] + expected), seen
