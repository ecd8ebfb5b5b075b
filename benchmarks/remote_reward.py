"""The reward phase with a remote scorer against the same scorer in process, side by side in one run.

    python benchmarks/remote_reward.py [--repeats 3] [--steps 8] [--warmup 2]
        -> benchmarks/results/remote_reward.json

The scorer is the digits CNN classifier. `steadyrl serve-reward configs/smoke.yaml --port 0` serves it (its own
Ray and Serve on 127.0.0.1, in another process). Each run is `steadyrl train configs/smoke.yaml` on the local
runtime with the default members (cnn, mlp, linear) and one more scorer beside them, trained on the CNN:

    in_process   kind python, benchmarks/remote_scorer.py:cnn_probability (the CNN in the training process)
    remote       kind http, protocol steadyrl, column cnn (the same CNN behind the service: one POST per step)

Runs alternate (which goes first turns each repeat). Per run: the median reward phase (`timing_s/reward`: every
member scored) and step over the steps after `--warmup`. Figures: remote - in_process of the reward phase (the
cost of going over HTTP, per step of 10 x group_size samples) and remote / in_process of the reward phase and step.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from figures import spread, write_json  # noqa: E402


def start_service() -> tuple[subprocess.Popen, str]:
    """`steadyrl serve-reward` in its own process group; (process, base URL) once it prints where it serves."""
    proc = subprocess.Popen([str(Path(sys.executable).parent / "steadyrl"), "serve-reward",
                             str(ROOT / "configs/smoke.yaml"), "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    t0 = time.time()
    for line in proc.stdout:
        match = re.search(r"POST (http://127\.0\.0\.1:\d+/\S+)/v1/score", line)
        if match:
            return proc, match.group(1)
        if time.time() - t0 > 600:
            break
    proc.kill()
    raise RuntimeError("steadyrl serve-reward did not come up")


def run(variant: str, url: str, steps: int, warmup: int, group_size: int) -> dict[str, Any]:
    from steadyrl.services.config import CONFIG_DIR
    from steadyrl.services.driver.controller import train
    from steadyrl.services.run_folder.metrics import read_metrics

    scorer = ("{name: extra, function: 'benchmarks.remote_scorer:cnn_probability'}" if variant == "in_process" else
              f"{{kind: http, name: extra, url: '{url}', column: cnn}}")
    with tempfile.TemporaryDirectory() as tmp:
        result = train(CONFIG_DIR / "smoke.yaml", [
            f"run.run_dir={tmp}/run", "run.runtime=local", "run.progress=false", f"run.steps={steps}",
            f"run.eval_every={steps}", f"run.checkpoint_every={steps}", f"sampler.group_size={group_size}",
            f"testbed.reward.functions=[{scorer}]"])
        rows = read_metrics(result.run_dir)[warmup:]
    return {"variant": variant, "reward_s_median": statistics.median(r["timing_s/reward"] for r in rows),
            "step_s_median": statistics.median(r["timing_s/step"] for r in rows),
            "extra_reward_mean": statistics.mean(r["reward/extra"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--out", default="benchmarks/results/remote_reward.json")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    sys.path.insert(0, str(ROOT))
    service, url = start_service()
    runs: list[dict[str, Any]] = []
    try:
        for r in range(args.repeats):
            for variant in (["in_process", "remote"] if r % 2 == 0 else ["remote", "in_process"]):
                runs.append({**run(variant, url, args.steps, args.warmup, args.group_size), "repeat": r})
                print(f"repeat {r} {variant}: reward {runs[-1]['reward_s_median'] * 1e3:.1f} ms, step "
                      f"{runs[-1]['step_s_median']:.2f} s", flush=True)
    finally:
        os.killpg(service.pid, signal.SIGINT)
        service.wait(timeout=120)

    def of(variant: str, key: str) -> list[float]:
        return [x[key] for x in sorted((x for x in runs if x["variant"] == variant), key=lambda x: x["repeat"])]

    local, remote = of("in_process", "reward_s_median"), of("remote", "reward_s_median")
    write_json({
        "config": "configs/smoke.yaml", "scorer": "the digits CNN classifier", "steps": args.steps,
        "warmup": args.warmup, "repeats": args.repeats, "samples_per_step": 10 * args.group_size,
        "reward_s": {"in_process": spread(local), "remote": spread(remote)},
        "remote_minus_in_process_ms": spread([1e3 * (b - a) for a, b in zip(local, remote)]),
        "remote_over_in_process": {
            "reward": spread([b / a for a, b in zip(local, remote)]),
            "step": spread([b / a for a, b in zip(of("in_process", "step_s_median"), of("remote", "step_s_median"))])},
        "runs": runs,
    }, args.out)


if __name__ == "__main__":
    main()
