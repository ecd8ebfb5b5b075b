"""Handoff across nodes: the same run on one node and on a one-machine multi-node cluster (a head and a raylet
per role on 127.0.0.1, each with its own object store; `ray.roles` puts the rollout worker, the learner and the
reward replica on their own nodes), side by side in one run of this script.

    python benchmarks/cross_node_handoff.py            # -> benchmarks/results/cross_node_handoff.json
    python benchmarks/cross_node_handoff.py --quick    # 3 steps

Per step, from each run's metrics (`services/runtime/driver_bytes.py`): bytes that cross between object stores
(`handoff/cross_node_batch_bytes`: batches, rollout node -> learner node; `handoff/cross_node_weight_bytes`:
published weights, learner node -> rollout node), bytes through the driver (`handoff/driver_bytes`, of which
tensors `handoff/driver_tensor_bytes`: summaries only), the batches' bytes for scale, and the weight sync's and
the step's seconds (`timing_s/sync`, `timing_s/step`). Medians with min..max over the steps after the first
(warm-up). Both runs are `steadyrl train` processes of configs/smoke.yaml; their metrics are also compared for
equality (the cluster computes what one node does). On one machine the cross-node bytes go over loopback: the
seconds say what the object stores' transfer costs here, not on a network.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from steadyrl.services.run_folder.metrics import read_metrics  # noqa: E402
from tests.helpers import ROLE_LABEL as LABEL  # noqa: E402
from tests.helpers import loopback_cluster  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
ROLES = [f"ray.roles.{role}.labels={{'{LABEL}': {role}}}" for role in ("rollout", "learner", "reward")]
KEYS = ("handoff/cross_node_batch_bytes", "handoff/cross_node_weight_bytes", "handoff/driver_bytes",
        "handoff/driver_tensor_bytes", "handoff/batch_bytes", "timing_s/sync", "timing_s/step")
VOLATILE = ("timing_s/", "perf/", "faults/", "handoff/")


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def train(run_dir: Path, address: str | None, steps: int, *extra: str) -> list[dict]:
    """`steadyrl train configs/smoke.yaml` in its own process, joining `address` (None: a local one-node Ray)."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    command = [sys.executable, "-m", "steadyrl.services.driver.cli", "train", "configs/smoke.yaml",
               f"run.run_dir={run_dir}", f"run.steps={steps}", f"run.checkpoint_every={steps}",
               f"run.eval_every={steps}", "run.progress=false", *([f"ray.address={address}"] if address else []),
               *extra]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    return read_metrics(run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 steps instead of 8")
    parser.add_argument("--out", type=Path, default=RESULTS / "cross_node_handoff.json")
    args = parser.parse_args()
    steps = 3 if args.quick else 8
    with tempfile.TemporaryDirectory() as tmp:
        one_node = train(Path(tmp) / "one", None, steps, "ray.num_cpus=2")
        cluster, _ = loopback_cluster({role: {} for role in ("rollout", "learner", "reward")})
        try:
            across = train(Path(tmp) / "cluster", cluster.address, steps, *ROLES)
        finally:
            cluster.shutdown()
    strip = [[{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows] for rows in (one_node, across)]
    result = {
        "command": "python benchmarks/cross_node_handoff.py" + (" --quick" if args.quick else ""),
        "config": "configs/smoke.yaml", "steps": steps,
        "layout": "one node: a local Ray with 2 CPUs; cluster: head (1 CPU) + rollout, learner, reward nodes (2 CPUs "
                  "each), every raylet and object store on 127.0.0.1, roles placed by node labels",
        "same_metrics_bitwise": strip[0] == strip[1],
        "per_step": {name: {key: spread([r[key] for r in rows[1:]]) for key in KEYS}
                     for name, rows in (("one_node", one_node), ("cluster", across))},
    }
    c, o = result["per_step"]["cluster"], result["per_step"]["one_node"]
    result["ratios"] = {"sync_seconds_cluster_over_one_node": c["timing_s/sync"]["median"] / o["timing_s/sync"]["median"],
                        "step_seconds_cluster_over_one_node": c["timing_s/step"]["median"] / o["timing_s/step"]["median"],
                        "driver_tensor_bytes_over_batch_bytes_cluster":
                            c["handoff/driver_tensor_bytes"]["median"] / c["handoff/batch_bytes"]["median"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
