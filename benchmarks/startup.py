"""Start-up: what a process imports before it works, and the default job's time to its first step, for this tree
against a baseline checkout (another commit), side by side.

    git worktree add /tmp/steadyrl-base <commit>
    python benchmarks/startup.py --baseline /tmp/steadyrl-base [--repeats 3] [--out ...]
        -> benchmarks/results/startup.json

Each repeat measures both trees, alternating which goes first. The baseline runs with this venv's packages and its
own `steadyrl` modules (a PYTHONPATH overlay of its rollout/, reward/, trainer/ and services/ folders, which Ray's
workers inherit). Per tree and repeat:
- import seconds of each process's entry module, each in a fresh interpreter: the CLI (`steadyrl --help`), the
  driver (`services.driver.controller`), a Serve reward replica (`services.serving.deployments`), a rollout worker
  (`services.runtime.actors`) and a learner rank (`services.runtime.learner_group`);
- `steadyrl --help`'s wall;
- the default job (configs/digits-grpo.yaml, `--steps` steps, on its own local Ray): its start-up, process start
  to the first step's start (imports, Ray, Serve, the actors, the reward app, the step-0 evaluation), and its wall
  (`benchmarks/services_overhead.run_job`).
Figures: this tree / baseline per repeat, median with min..max.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import spread, write_json  # noqa: E402
from services_overhead import ROOT, run_job  # noqa: E402

ENTRY_MODULES = {"cli": "steadyrl.services.driver.cli", "driver": "steadyrl.services.driver.controller",
                 "reward_replica": "steadyrl.services.serving.deployments",
                 "rollout_worker": "steadyrl.services.runtime.actors", "learner": "steadyrl.services.runtime.learner_group"}
PACKAGES = ("rollout", "reward", "trainer", "services")


def overlay(checkout: Path, into: Path) -> dict[str, str]:
    """The environment that makes `import steadyrl.*` load `checkout`'s modules instead of this tree's."""
    pkg = into / "steadyrl"
    pkg.mkdir(parents=True)
    for name in PACKAGES:
        (pkg / name).symlink_to(checkout.resolve() / name)
    return {"PYTHONPATH": str(into)}


def timed(cmd: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, check=True, capture_output=True)
    return time.perf_counter() - t0


def head_commit(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()


def measure(env: dict[str, str], steps: int) -> dict[str, Any]:
    """One repeat of one tree."""
    imports = {role: timed([sys.executable, "-c", f"import {module}"], env) for role, module in ENTRY_MODULES.items()}
    cli_help = timed([sys.executable, "-c", "from steadyrl.services.driver.cli import app; app(['--help'])"], env)
    job = run_job("ray", steps, env=env)
    return {"import_s": imports, "cli_help_s": cli_help, "job_startup_s": job["startup_s"], "job_wall_s": job["wall_s"],
            "job_step_s_median": job["step_s_median"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, type=Path, help="a checkout of the commit to compare against")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/startup.json")
    args = ap.parse_args()
    if not (args.baseline / "services" / "cli.py").is_file():
        raise SystemExit(f"--baseline {args.baseline}: not a steadyrl checkout (no services/driver/cli.py)")
    runs: dict[str, list[dict[str, Any]]] = {"this": [], "baseline": []}
    with tempfile.TemporaryDirectory(prefix="steadyrl-baseline-") as tmp:
        envs = {"this": {}, "baseline": overlay(args.baseline, Path(tmp))}
        for r in range(args.repeats):
            for tree in (["baseline", "this"] if r % 2 == 0 else ["this", "baseline"]):
                runs[tree].append(measure(envs[tree], args.steps))
                run = runs[tree][-1]
                print(f"repeat {r} {tree}: job start-up {run['job_startup_s']:.1f}s wall {run['job_wall_s']:.1f}s "
                      f"--help {run['cli_help_s']:.2f}s", flush=True)

    def of(tree: str, get: Any) -> list[float]:
        return [get(run) for run in runs[tree]]

    def figure(get: Any) -> dict[str, Any]:
        this, base = of("this", get), of("baseline", get)
        return {"this": spread(this), "baseline": spread(base), "ratio": spread([a / b for a, b in zip(this, base)])}

    result = {
        "baseline": head_commit(args.baseline), "this": head_commit(ROOT),
        "config": "configs/digits-grpo.yaml", "steps": args.steps, "repeats": args.repeats,
        "job_startup_s": figure(lambda run: run["job_startup_s"]),
        "job_wall_s": figure(lambda run: run["job_wall_s"]),
        "cli_help_s": figure(lambda run: run["cli_help_s"]),
        "import_s": {role: figure(lambda run, role=role: run["import_s"][role]) for role in ENTRY_MODULES},
        "job_step_s_median": {t: statistics.median(of(t, lambda run: run["job_step_s_median"])) for t in runs},
        "runs": runs,
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
