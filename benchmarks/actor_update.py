"""Where the Ray runtime's slower update comes from: the learner's update in this process and in a Ray learner actor,
side by side, first with Ray's processes beside them, then with Serve and the reward replicas too.

    python benchmarks/actor_update.py [--repeats 6] [--config configs/digits-grpo.yaml] [override ...]
        -> benchmarks/results/actor_update.json

One batch is sampled and scored in this process (the product's `Rollouts` and in-process reward ensemble), without
its policy version, so every update below takes it as current. Each update recomputes the old log-probs
(`learner.old_logp=recompute`: every update the same work). The same `learner_rank` code runs

- in this process, before Ray starts (`alone`);
- after `init_ray` (the product's local Ray: GCS, raylet, its workers) alternately in this process (`process`) and
  in a `LearnerActor` (`actor`, the product's learner rank as a Ray actor, its time read from `timing_s/update`);
- after `start_serve` and `deploy_reward_app` (Serve's controller and proxy, one replica per reward model and the
  ensemble, idle), the same alternation.

Ratios per stage, medians over repeats with min..max: actor / process (what being an actor costs: Ray's threads
in the process, its environment) and process / alone (what Ray's and Serve's idle processes take from the cores).
CPU seconds each Ray and Serve process spent during each stage's updates (psutil) say which one it is.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from figures import spread, write_json  # noqa: E402
from services_overhead import cpu_by_role, process_tree_cpu  # noqa: E402
from steadyrl.rollout.batch import POLICY_VERSION  # noqa: E402
from steadyrl.rollout.numerics import using_threads  # noqa: E402
from steadyrl.services.config import load_config  # noqa: E402
from steadyrl.services.runtime.learner_rank import build_rank, update_on  # noqa: E402
from steadyrl.services.runtime.local_runtime import LocalScorer  # noqa: E402
from steadyrl.services.runtime.rank_env import free_port, torch_threads  # noqa: E402
from steadyrl.services.runtime.rollouts import Rollouts  # noqa: E402
from steadyrl.services.testbeds import build_testbed  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "actor_update.json"


def ray_processes_cpu(own_pid: int) -> dict[int, tuple[str, float]]:
    """CPU readings of this process's descendants (the local Ray's processes)."""
    return {pid: v for pid, v in process_tree_cpu(own_pid, {}).items() if pid != own_pid}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "digits-grpo.yaml"))
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    cfg = load_config(args.config, ["learner.old_logp=recompute", *args.overrides])
    threads = torch_threads(cfg)
    torch.set_num_threads(threads)
    testbed = build_testbed(cfg)
    base = load_file(str(testbed.base_weights(progress=True)))
    testbed.prepare_rewards(None)
    with using_threads(threads):
        rollouts, scorer = Rollouts(cfg, base), LocalScorer(testbed.reward_ensemble())
        batch = rollouts.generate(0, 0, 1, scorer)[0]
    batch = batch.replace(extras={k: v for k, v in batch.extras.items() if k != POLICY_VERSION})
    learner = build_rank(cfg, base, 0, 1, "127.0.0.1", free_port())
    update_on(learner, [batch])  # warm-up

    def in_process() -> float:
        return update_on(learner, [batch])["timing_s/update"]

    times: dict[str, list[float]] = {"alone": [in_process() for _ in range(args.repeats)]}
    cpu: dict[str, dict[str, float]] = {}
    print(f"alone: {statistics.median(times['alone']):.2f}s", flush=True)

    import ray

    from steadyrl.services.runtime.learner_group import LearnerGroup
    from steadyrl.services.runtime.ray_session import init_ray, start_serve
    from steadyrl.services.serving.app import deploy_reward_app

    init_ray(None, cfg.ray.num_cpus, cfg.ray.local_network, cfg.ray.worker_niceness)
    with tempfile.TemporaryDirectory(prefix="steadyrl-actor-update-") as run_dir:
        group = LearnerGroup(cfg, ray.put(base), run_dir)
        group.start()
        group.infos()
        batch_ref = ray.put(batch)
        actor = group.actors[0]

        def in_actor() -> float:
            return ray.get(actor.update.remote(batch_ref))["timing_s/update"]

        in_actor()  # warm-up
        for stage in ("ray", "ray+serve"):
            if stage == "ray+serve":
                start_serve(cfg.serve, Path(run_dir) / "serve")
                deploy_reward_app(testbed, cfg.serve)
                time.sleep(5)  # replicas up and idle
            times[f"{stage}: process"], times[f"{stage}: actor"] = [], []
            before = ray_processes_cpu(os.getpid())
            for r in range(args.repeats):
                order = (in_process, in_actor) if r % 2 == 0 else (in_actor, in_process)
                for fn in order:
                    times[f"{stage}: {'process' if fn is in_process else 'actor'}"].append(fn())
            cpu[stage] = {k: v for k, v in cpu_by_role(ray_processes_cpu(os.getpid()), before).items() if v > 0.01}
            print(f"{stage}: process {statistics.median(times[f'{stage}: process']):.2f}s "
                  f"actor {statistics.median(times[f'{stage}: actor']):.2f}s cpu {cpu[stage]}", flush=True)
        group.kill()
    ray.shutdown()
    times["alone again"] = [in_process() for _ in range(args.repeats)]  # the machine's drift over the run
    print(f"alone again: {statistics.median(times['alone again']):.2f}s", flush=True)

    def ratio(a: str, b: str) -> dict[str, float]:
        return spread([x / y for x, y in zip(times[a], times[b])])

    result: dict[str, Any] = {
        "config": str(Path(args.config).resolve().relative_to(ROOT)), "overrides": args.overrides,
        "repeats": args.repeats, "torch_threads": threads, "cores": os.cpu_count(), "batch": len(batch),
        "update_s_median": {k: statistics.median(v) for k, v in times.items()},
        "actor_over_process": {s: ratio(f"{s}: actor", f"{s}: process") for s in ("ray", "ray+serve")},
        "process_over_alone": {s: spread([x / statistics.median(times["alone"]) for x in times[f"{s}: process"]])
                               for s in ("ray", "ray+serve")},
        "ray_cpu_s_during_stage": cpu,
        "update_s": times,
    }
    write_json(result, args.out, leave_out_of_summary=("update_s",))


if __name__ == "__main__":
    main()
