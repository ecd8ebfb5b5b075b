"""Memory: the peak RSS of every process of a run, and the learner's update with activation checkpointing on/off.

    python benchmarks/memory.py [--steps 4] [--repeats 3] [--sd3-runtime ray|local] [--ckpt-steps 3]
                                [--jobs digits sd3] [--parts processes checkpointing]
                                [--out benchmarks/results/memory.json]

(--parts measures only those parts; the others keep their figures from --out.)

Two jobs: `digits` (configs/digits-grpo.yaml, the default job) and `sd3` (a tiny random SD3-style pipeline with
LoRA adapters and a tiny CLIP reward, as benchmarks/gpu_check.py's `tiny_overrides("sd3", ...)` builds them).
Every run is the product loop (`steadyrl.services.driver.controller.train`) in a fresh subprocess (this file with
`--driver`), on CPU, `ray.torch_threads=1`, evaluation and checkpoints only where the loop forces them.

1. Processes (`--parts processes`). A run through Ray (`run.runtime=ray`; `--sd3-runtime local` runs the sd3 job
   in one process instead). While it runs, every `--interval` s (0.2) this process reads /proc/PID/status of the
   driver and of each of its descendants (Ray's gcs/raylet/dashboard, the actors: rollout and learner pids from
   the run's actors.json, Serve's controller, proxy and one replica per reward deployment, named from the Ray
   process titles). peak_rss = max over samples of VmRSS; vmhwm = the kernel's exact peak (VmHWM) at the last
   read before the process exited. job_rss_peak = max over samples of the sum of VmRSS (a page the processes
   share, e.g. of torch's libraries, counts in each of them); job_pss_peak the same over Pss
   (/proc/PID/smaps_rollup, each shared page split between its processes; read every 5th sample).
   Per role: median and min..max over --repeats runs of the role's largest process.

2. Activation checkpointing (`--parts checkpointing`). `run.runtime=local` runs of --ckpt-steps steps with
   `learner.balanced.activation_checkpointing` false and true, alternated, each in a fresh process. Around each
   real `DeepSpeedLearner.update` the driver wraps (the loop itself is untouched): gc, malloc_trim(0), VmHWM reset
   to the current RSS (write 5 to /proc/self/clear_refs), the update, then VmHWM. update_peak = VmHWM after minus
   VmRSS before (what the update adds), update_s its seconds; the first update (optimizer state, lazy
   initialisation) is reported but left out of the medians. `checkpointing_active`: whether any module of the
   learner's network has `gradient_checkpointing` set (false: the option did nothing on this model).
   Ratios on/off of the medians.

Writes --out (JSON) and its .png (peak RSS per role, one panel per job).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import spread  # noqa: E402 - benchmarks/figures.py
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "memory.json"
COMMON = ["ray.torch_threads=1", "run.progress=false", "run.eval_every=100000", "run.checkpoint_every=100000",
          "serve.port=0", "ray.rollout_gpus=0", "ray.learner_gpus=0", "learner.backend=gloo"]
MB = 1024.0  # /proc reports kB
PARTS = ["processes", "checkpointing"]


# ------------------------------------------------------------------------------------------------ /proc
def proc_kb(pid: int | str, keys: tuple[str, ...], name: str = "status") -> dict[str, int] | None:
    """The kB fields `keys` of /proc/PID/<name> (status or smaps_rollup); None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/{name}").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            out[key] = int(rest.split()[0])
    return out


def title(pid: int) -> str:
    """The process's title (Ray rewrites it: `ray::RolloutWorker`, `ray::SERVE_REPLICA::reward#cnn#...`)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def children(pid: int) -> set[int]:
    """All descendants of pid (Ray's local cluster is started by the driver: every Ray process descends from it)."""
    by_parent: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            stat = proc_kb(entry.name, ("PPid",))
            if stat and "PPid" in stat:
                by_parent.setdefault(stat["PPid"], []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in by_parent.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def role_of(name: str) -> str:
    """A role from a process title: ray::X -> X (Serve's replicas by deployment), else the program's name."""
    if name.startswith("ray::"):
        actor = name[5:].split()[0]
        if actor.startswith("SERVE_REPLICA::"):  # while the replica starts: SERVE_REPLICA::app#deployment#id
            return "serve_replica:" + actor.split("#")[1]
        if actor.startswith("ServeReplica:"):  # then ServeReplica:app:deployment
            return "serve_replica:" + actor.split(":")[-1].split(".")[0]
        return {"ServeController": "serve_controller", "ProxyActor": "serve_proxy", "IDLE": "ray_idle_worker"}.get(
            actor.split(".")[0], "ray:" + actor.split(".")[0])
    argv = name.split() or ["?"]
    prog = argv[0]
    if Path(prog).name.startswith("python"):  # a Python program: its script (dashboard.py, default_worker.py)
        prog = next((a for a in argv[1:] if a.endswith(".py")), prog)
    return "ray:" + Path(prog).stem


# ------------------------------------------------------------------------------------------------ 1. processes
def watch(cmd: list[str], run_dir: Path, interval: float) -> dict[str, Any]:
    """Run cmd (the driver), sampling the memory of it and its descendants until it exits."""
    driver = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    procs: dict[int, dict[str, Any]] = {}
    job_rss = job_pss = 0.0
    tick = 0
    t0 = time.perf_counter()
    while driver.poll() is None:
        pids = {driver.pid} | children(driver.pid)
        total = pss = 0.0
        for pid in pids:
            st = proc_kb(pid, ("VmRSS", "VmHWM"))
            if not st or "VmRSS" not in st:
                continue  # exited, or a kernel thread
            p = procs.setdefault(pid, {"peak_rss_mb": 0.0, "title": ""})
            p["peak_rss_mb"] = max(p["peak_rss_mb"], st["VmRSS"] / MB)
            p["vmhwm_mb"] = st["VmHWM"] / MB
            name = "driver" if pid == driver.pid else title(pid)
            if name and "IDLE" not in name or not p["title"]:
                p["title"] = name  # a worker that became an actor keeps the actor's title
            total += st["VmRSS"] / MB
            if tick % 5 == 0:
                pss += (proc_kb(pid, ("Pss",), "smaps_rollup") or {}).get("Pss", 0) / MB
        job_rss = max(job_rss, total)
        job_pss = max(job_pss, pss)
        tick += 1
        time.sleep(interval)
    log = driver.stdout.read()
    if driver.returncode != 0:
        raise RuntimeError(f"run failed ({driver.returncode}): {' '.join(cmd)}\n{log[-3000:]}")
    actors = json.loads((run_dir / "actors.json").read_text())["actors"] if (run_dir / "actors.json").exists() else {}
    by_pid = {a["pid"]: f"{a['role']}_{a['index']}" for a in actors.values()}
    roles: dict[str, dict[str, Any]] = {}
    for pid, p in procs.items():
        p["role"] = role = "driver" if pid == driver.pid else by_pid.get(pid, role_of(p["title"]))
        r = roles.setdefault(role, {"processes": 0, "peak_rss_mb": 0.0, "vmhwm_mb": 0.0})
        r["processes"] += 1
        r["peak_rss_mb"] = max(r["peak_rss_mb"], p["peak_rss_mb"])
        r["vmhwm_mb"] = max(r["vmhwm_mb"], p["vmhwm_mb"])
    return {"wall_s": time.perf_counter() - t0, "samples": tick, "job_rss_peak_mb": job_rss,
            "job_pss_peak_mb": job_pss, "roles": roles,
            "processes": [{"pid": pid, **p, "title": p["title"][:120]} for pid, p in procs.items()]}


def role_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A role over repeats: its process count and the spread of its peaks."""
    return {"processes": max(r["processes"] for r in runs), "repeats_seen": len(runs),
            **{k: spread([r[k] for r in runs]) for k in ("peak_rss_mb", "vmhwm_mb")}}


def processes(jobs: dict[str, tuple[list[str], str]], steps: int, repeats: int, interval: float,
              tmp: Path) -> dict[str, Any]:
    out = {}
    for job, (overrides, runtime) in jobs.items():
        runs = []
        for rep in range(repeats):
            run_dir = tmp / f"{job}_ray_{rep}"
            cmd = driver_cmd([*overrides, *COMMON, f"run.steps={steps}", f"run.runtime={runtime}",
                              f"run.run_dir={run_dir}"])
            runs.append(watch(cmd, run_dir, interval))
            print(f"{job} ({runtime}) repeat {rep}: {runs[-1]['wall_s']:.0f}s, job RSS peak "
                  f"{runs[-1]['job_rss_peak_mb']:.0f} MB, PSS {runs[-1]['job_pss_peak_mb']:.0f} MB", flush=True)
        roles = sorted({r for run in runs for r in run["roles"]})
        out[job] = {"runtime": runtime, "steps": steps, "repeats": repeats,
                    "job_rss_peak_mb": spread([r["job_rss_peak_mb"] for r in runs]),
                    "job_pss_peak_mb": spread([r["job_pss_peak_mb"] for r in runs]),
                    "roles": {role: role_summary([r["roles"][role] for r in runs if role in r["roles"]])
                              for role in roles},
                    "runs": runs}
    return out


# ------------------------------------------------------------------------------------------------ 2. checkpointing
def checkpointing(jobs: dict[str, tuple[list[str], str]], steps: int, repeats: int, tmp: Path) -> dict[str, Any]:
    out = {}
    for job, (overrides, _) in jobs.items():
        per: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
        for rep in range(repeats):
            for setting in ("off", "on"):
                run_dir = tmp / f"{job}_ckpt_{setting}_{rep}"
                report = tmp / f"{run_dir.name}.json"
                cmd = driver_cmd([*overrides, *COMMON, f"run.steps={steps}", "run.runtime=local",
                                  f"learner.balanced.activation_checkpointing={setting == 'on'}",
                                  f"run.run_dir={run_dir}"], report)
                done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
                if done.returncode != 0:
                    raise RuntimeError(f"{job} checkpointing={setting} failed:\n{done.stderr[-3000:]}")
                per[setting].append(json.loads(report.read_text()))
                u = per[setting][-1]["updates"]
                print(f"{job} checkpointing {setting} repeat {rep}: update peak MB "
                      f"{[round(x['update_peak_mb']) for x in u]}, s {[round(x['update_s'], 2) for x in u]}")
        summary: dict[str, Any] = {}
        for setting, runs in per.items():
            later = [u for run in runs for u in (run["updates"][1:] or run["updates"])]
            summary[setting] = {
                "checkpointing_active": all(run["checkpointing_active"] for run in runs),
                "update_peak_mb": spread([u["update_peak_mb"] for u in later]),
                "update_abs_peak_mb": spread([u["peak_mb"] for u in later]),
                "update_s": spread([u["update_s"] for u in later]),
                "process_vmhwm_mb": spread([run["process_vmhwm_mb"] for run in runs]), "runs": runs}
        ratio = {k: summary["on"][k]["median"] / summary["off"][k]["median"]
                 for k in ("update_peak_mb", "update_abs_peak_mb", "update_s", "process_vmhwm_mb")}
        out[job] = {"steps": steps, "repeats": repeats, **summary, "ratio_on_over_off": ratio}
    return out


def measure_updates() -> tuple[list[dict[str, float]], dict[str, bool]]:
    """Wrap DeepSpeedLearner.update (in this driver process) to record each update's RSS peak and time."""
    from steadyrl.trainer.learner import DeepSpeedLearner

    libc = ctypes.CDLL("libc.so.6")
    inner, records, flags = DeepSpeedLearner.update, [], {}

    def update(self, *args, **kwargs):
        flags.setdefault("active", any(getattr(m, "gradient_checkpointing", False) for m in self.network.modules()))
        gc.collect()
        libc.malloc_trim(0)
        before = proc_kb("self", ("VmRSS",))["VmRSS"]
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS (Linux >= 4.0)
        t0 = time.perf_counter()
        result = inner(self, *args, **kwargs)
        seconds = time.perf_counter() - t0
        peak = proc_kb("self", ("VmHWM",))["VmHWM"]
        records.append({"rss_before_mb": before / MB, "peak_mb": peak / MB, "update_peak_mb": (peak - before) / MB,
                        "update_s": seconds})
        return result

    DeepSpeedLearner.update = update
    return records, flags


# ------------------------------------------------------------------------------------------------ driver, plot
def driver_cmd(overrides: list[str], report: Path | None = None) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "--driver", json.dumps(overrides),
            *(["--report", str(report)] if report else [])]


def run_driver(overrides: list[str], report: Path | None) -> None:
    """One run of the product loop in this process (with --report: its updates measured, written there)."""
    sys.path.insert(0, str(ROOT))
    from steadyrl.services.driver.controller import train

    records, flags = measure_updates() if report else ([], {})
    config = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    train(config, overrides)
    if report:
        report.write_text(json.dumps({"updates": records, "checkpointing_active": flags.get("active", False),
                                      "process_vmhwm_mb": proc_kb("self", ("VmHWM",))["VmHWM"] / MB}))


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = result.get("processes", {})
    if not jobs:
        return
    fig, axes = plt.subplots(1, len(jobs), figsize=(7 * len(jobs), 5), squeeze=False)
    for ax, (job, data) in zip(axes[0], jobs.items()):
        roles = sorted(data["roles"], key=lambda r: -data["roles"][r]["peak_rss_mb"]["median"])
        med = [data["roles"][r]["peak_rss_mb"]["median"] for r in roles]
        err = [[m - data["roles"][r]["peak_rss_mb"]["min"] for r, m in zip(roles, med)],
               [data["roles"][r]["peak_rss_mb"]["max"] - m for r, m in zip(roles, med)]]
        ax.barh(roles[::-1], med[::-1], xerr=[e[::-1] for e in err], color="tab:blue")
        ax.set_xlabel("peak RSS (MB), median, min..max over repeats")
        ax.set_title(f"{job} ({data['runtime']}, {data['steps']} steps): job PSS peak "
                     f"{data['job_pss_peak_mb']['median']:.0f} MB", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4, help="RL steps of each process-memory run")
    parser.add_argument("--ckpt-steps", type=int, default=3, help="RL steps (updates) of each checkpointing run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between memory samples")
    parser.add_argument("--sd3-runtime", choices=["ray", "local"], default="ray")
    parser.add_argument("--jobs", nargs="+", default=["digits", "sd3"], choices=["digits", "sd3"])
    parser.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS,
                        help="what to measure now (a part not given keeps its figures from --out)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--driver", help=argparse.SUPPRESS)  # internal: one run, its overrides as JSON
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver is not None:
        return run_driver(json.loads(args.driver), args.report)

    sys.path.insert(0, str(ROOT))
    from benchmarks.gpu_check import tiny_overrides

    # a part not run now keeps its figures (and settings) from --out
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    settings = {k: v for k, v in vars(args).items() if k not in ("driver", "report", "out")}
    result: dict[str, Any] = {"settings": {part: previous.get("settings", {}).get(part) for part in PARTS},
                              "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]}}
    for part in PARTS:
        if part in args.parts:
            result["settings"][part] = settings
        elif part in previous:
            result[part] = previous[part]
    with tempfile.TemporaryDirectory(prefix="steadyrl-memory-") as tmp_name:
        tmp = Path(tmp_name)
        all_jobs = {"digits": (["configs/digits-grpo.yaml"], "ray"),
                    "sd3": (tiny_overrides("sd3", tmp / "assets") if "sd3" in args.jobs else [], args.sd3_runtime)}
        jobs = {k: v for k, v in all_jobs.items() if k in args.jobs}
        if "processes" in args.parts:
            result["processes"] = processes(jobs, args.steps, args.repeats, args.interval, tmp)
        if "checkpointing" in args.parts:
            result["checkpointing"] = checkpointing(jobs, args.ckpt_steps, args.repeats, tmp)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    plot(result, args.out.with_suffix(".png"))
    print(json.dumps({job: {r: round(v["peak_rss_mb"]["median"]) for r, v in d["roles"].items()}
                      for job, d in result.get("processes", {}).items()}, indent=1))
    print(json.dumps({job: d["ratio_on_over_off"] for job, d in result.get("checkpointing", {}).items()}, indent=1))


if __name__ == "__main__":
    main()
