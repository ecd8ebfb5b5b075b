"""Time to a held-out target: each arm (a preset and its overrides) on several seeds, until its held-out
evaluation first reaches the target or its step budget runs out.

    python benchmarks/time_to_target.py [--arm LABEL=CONFIG [key=value ...]] ... [--seeds 0 1 2] [--target 0.95]
        [--eval-every 5] [--steps N] [--until target|budget] [--runtime local] [--baseline LABEL] [--keep DIR]
        [--reuse EARLIER.json ...] [--out benchmarks/results/time_to_target.json]

Each run is `steadyrl train --local` (the product loop in one process; `--runtime ray`: `steadyrl train` over a
local Ray and Serve) in its own subprocess, one after another, with `run.eval_every` small enough to place the
crossing (the evaluation is the preset's own seeded held-out set) and, with `--until target`, `run.target_held_out`
ending the run at the crossing. Per run (services/run_folder/time_to_target.py): the first evaluated step at or
above the target, the seconds of training steps and the rollout samples until then, the final held-out, proxy and
diversity, the reward-hacking verdict, and the command's whole wall time (start-up and evaluations included). Per
arm: the median and min..max over its seeds. Also a PNG of held-out against training seconds, a line per run, a
colour per arm. Default target: 95 % on digits, 92 % exact match on arith (base 85.6 %). With `--baseline`, each
other arm is judged by the sweep's rule (`keep_verdict`): kept only if no worse at the end in held-out and diversity
within the baseline seeds' spread, with no reward hacking flagged. `--reuse` takes an arm's runs from an earlier
output instead of running them again when that output ran the same config, overrides, seeds, target, evaluation
interval, step budget, stopping rule and runtime (the arm records which file it came from), so that a sweep grows
arm by arm with every arm in one JSON.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from figures import spread, write_json  # noqa: E402

DEFAULT_TARGETS = {"digits": 0.95, "arith": 0.92}  # held-out level per testbed when --target is not given
DEFAULT_ARM = "default=configs/digits-grpo.yaml"


def parse_arm(text: str) -> tuple[str, str, list[str]]:
    """'LABEL=CONFIG key=value ...' -> (label, config, overrides)."""
    head, *overrides = text.split()
    label, sep, config = head.partition("=")
    if not sep or not label or not config:
        raise argparse.ArgumentTypeError(f"--arm {text!r}: expected 'LABEL=CONFIG [key=value ...]'")
    if not (ROOT / config).is_file() and not Path(config).is_file():
        raise argparse.ArgumentTypeError(f"--arm {text!r}: no config file {config}")
    return label, config, overrides


def one_run(config: str, overrides: list[str], run: Path, runtime: str) -> float:
    """`steadyrl train` of one arm and seed into `run`; the command's wall seconds."""
    cmd = [sys.executable, "-m", "steadyrl.services.driver.cli", "train", config, f"run.runtime={runtime}",
           f"run.run_dir={run}", "run.progress=false", "serve.port=0", *overrides]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return time.perf_counter() - t0


def run_record(run: Path, target: float, wall_s: float) -> dict:
    """What one finished run shows: its time to the target, final evaluation and verdict."""
    from steadyrl.services.run_folder.reader import hacking_verdict, load_run
    from steadyrl.services.run_folder.time_to_target import held_out_curve, time_to_target

    folder = load_run(run)
    final = folder.evals[-1]
    verdict = hacking_verdict(folder.evals)
    return {**time_to_target(folder, target).as_dict(), "steps_run": int(folder.metrics[-1]["step"]),
            "final_held_out": final["held_out"], "final_proxy": final.get("proxy_mean"),
            "final_diversity_nn": final.get("diversity_nn"), "base_held_out": folder.evals[0]["held_out"],
            "base_diversity_nn": folder.evals[0].get("diversity_nn"), "hacking_suspected": verdict.suspected,
            "command_wall_s": wall_s, "curve": held_out_curve(folder)}


def arm_summary(runs: list[dict]) -> dict:
    """Median and min..max over the arm's seeds of what reached the target, and how many did."""
    reached = [r for r in runs if r["reached"]]
    out = {"seeds": len(runs), "reached": len(reached),
           "hacking_flagged": sum(bool(r["hacking_suspected"]) for r in runs)}
    for key in ("step", "train_s", "samples"):
        values = [float(r[key]) for r in reached]
        out[key] = spread(values) if values else None
    for key in ("final_held_out", "final_diversity_nn", "final_proxy", "command_wall_s"):
        out[key] = spread([float(r[key]) for r in runs if r[key] is not None])
    return out


def keep_verdict(arm: dict, baseline: dict) -> dict:
    """The sweep's rule against the baseline arm: a setting is kept only if its median final held-out and diversity
    are no worse than the baseline's lowest seed (no worse within the seeds' spread) and no run flags reward
    hacking (and every run reached the target); beside the verdict, the speed-up of its median training seconds to
    the target over the baseline's."""
    reasons = []
    for key in ("final_held_out", "final_diversity_nn"):
        if arm[key]["median"] < baseline[key]["min"]:
            reasons.append(f"{key} median {arm[key]['median']:.3f} < baseline min {baseline[key]['min']:.3f}")
    if arm["hacking_flagged"]:
        reasons.append(f"reward hacking flagged in {arm['hacking_flagged']} run(s)")
    if arm["reached"] < arm["seeds"]:
        reasons.append(f"target reached in {arm['reached']} of {arm['seeds']} runs")
    speedup = (baseline["train_s"]["median"] / arm["train_s"]["median"]
               if arm["train_s"] and baseline["train_s"] else None)
    return {"kept": not reasons, "reasons": reasons, "speedup_train_s": speedup}


def reusable_arm(earlier: list[Path], label: str, config: str, overrides: list[str], setup: dict) -> dict | None:
    """The arm `label` from the first earlier output that ran it exactly as this sweep would (config, overrides and
    `setup`: seeds, target, eval_every, steps, until, runtime), with `reused_from` naming that file; else None."""
    for path in earlier:
        old = json.loads(path.read_text())
        arm = old["arms"].get(label)
        was = {"seeds": old["seeds"], "target": old["target_held_out"], "eval_every": old["eval_every"],
               "steps": old.get("steps"), "until": old["until"], "runtime": old["runtime"]}
        if arm and arm["config"] == config and arm["overrides"] == overrides and was == setup:
            return {**{k: v for k, v in arm.items() if k != "against_baseline"},
                    "reused_from": arm.get("reused_from", str(path))}
    return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arm", action="append", type=parse_arm, help=f"LABEL=CONFIG [key=value ...] (repeat; "
                    f"default {DEFAULT_ARM!r})")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--target", type=float, default=None, help="held-out level (default per testbed: "
                    + ", ".join(f"{k} {v:g}" for k, v in DEFAULT_TARGETS.items()) + ")")
    ap.add_argument("--eval-every", type=int, default=5, help="steps between held-out evaluations")
    ap.add_argument("--steps", type=int, default=None, help="step budget (default: each preset's run.steps)")
    ap.add_argument("--until", choices=("target", "budget"), default="target",
                    help="target: end each run at its crossing (run.target_held_out); budget: run every step, so "
                    "the final held-out and diversity compare at one step count")
    ap.add_argument("--runtime", choices=("local", "ray"), default="local")
    ap.add_argument("--baseline", default=None, help="an arm's label: judge every other arm against it "
                    "(keep_verdict; run with --until budget so the final values compare at one step count)")
    ap.add_argument("--keep", type=Path, default=None, help="keep the run folders here (default: deleted)")
    ap.add_argument("--reuse", type=Path, nargs="+", default=[], help="earlier outputs of this script: an arm they "
                    "ran with the same config, overrides, seeds and settings is taken from them, not run again")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/time_to_target.json"))
    args = ap.parse_args()
    for path in args.reuse:
        if not path.is_file():
            ap.error(f"--reuse: no file {path}")
    arms = args.arm or [parse_arm(DEFAULT_ARM)]
    if len({label for label, _, _ in arms}) != len(arms):
        ap.error("--arm labels must differ")
    if args.baseline is not None and args.baseline not in {label for label, _, _ in arms}:
        ap.error(f"--baseline {args.baseline!r} is not an arm's label")

    from steadyrl.services.config import load_config
    from steadyrl.services.run_folder.figures import save_held_out_vs_time

    testbeds = {load_config(ROOT / config, overrides).testbed.name for _, config, overrides in arms}
    target = args.target
    if target is None:
        known = {DEFAULT_TARGETS.get(t) for t in testbeds}
        if None in known or len(known) != 1:
            ap.error(f"--target: no single default for testbeds {sorted(testbeds)}; give one")
        target = known.pop()

    setup = {"seeds": args.seeds, "target": target, "eval_every": args.eval_every, "steps": args.steps,
             "until": args.until, "runtime": args.runtime}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = args.keep or Path(tmp)
        total, n = len(arms) * len(args.seeds), 0
        for label, config, overrides in arms:
            reused = reusable_arm(args.reuse, label, config, overrides, setup)
            if reused is not None:
                n += len(args.seeds)
                print(f"[{n}/{total}] {label}: reused from {reused['reused_from']}", flush=True)
                results[label] = reused
                continue
            runs = []
            for seed in args.seeds:
                n += 1
                extra = [f"run.seed={seed}", f"run.eval_every={args.eval_every}",
                         *([f"run.steps={args.steps}"] if args.steps else []),
                         *([f"run.target_held_out={target}"] if args.until == "target" else []), *overrides]
                run = folders / f"{label}-seed{seed}"
                wall = one_run(config, extra, run, args.runtime)
                runs.append({"seed": seed, **run_record(run, target, wall)})
                r = runs[-1]
                where = f"step {r['step']}, {r['train_s']:.1f} s" if r["reached"] else "not reached"
                print(f"[{n}/{total}] {label} seed {seed}: {where}; final held-out {r['final_held_out']:.3f}, "
                      f"diversity {r['final_diversity_nn']:.2f} ({wall:.0f} s)", flush=True)
            results[label] = {"config": config, "overrides": overrides, "runs": runs, "summary": arm_summary(runs)}

    if args.baseline is not None:
        for label, res in results.items():
            if label != args.baseline:
                res["against_baseline"] = keep_verdict(res["summary"], results[args.baseline]["summary"])
    png = args.out.with_suffix(".png")
    save_held_out_vs_time({label: [r["curve"] for r in res["runs"]] for label, res in results.items()}, target, png,
                          f"time to {target:.0%} held-out ({len(args.seeds)} seeds per arm)")
    write_json({
        "command": "python benchmarks/time_to_target.py " + " ".join(sys.argv[1:]),
        "target_held_out": target, "seeds": args.seeds, "eval_every": args.eval_every, "steps": args.steps,
        "until": args.until,
        "runtime": args.runtime, "figure": str(png), "arms": results,
        "note": "train_s: seconds of training steps (timing_s/step) up to the first evaluation at or above the "
                "target; command_wall_s: the whole command (start-up, evaluations, checkpoints)"},
               args.out, leave_out_of_summary=("arms",))
    for label, res in results.items():
        s = res["summary"]
        t = s["train_s"]
        print(f"{label}: reached {s['reached']}/{s['seeds']}"
              + (f", {t['median']:.1f} s [{t['min']:.1f}..{t['max']:.1f}] at step {s['step']['median']:.0f}" if t
                 else "")
              + (f"; kept: {res['against_baseline']['kept']} {res['against_baseline']['reasons']}"
                 if "against_baseline" in res else ""))
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
