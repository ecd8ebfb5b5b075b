"""The GPU smoke check: every GPU path of steadyrl in one command, each case in a process of its own under its own
timeout, CPU/GPU parity on each case's first step, one JSON and a one-screen summary.

    bash benchmarks/gpu_smoke.sh [WHEEL_DIR] [--out FILE] [--cases digits,sd3,...]   # installs, then runs this
    python -m benchmarks.gpu_smoke --out benchmarks/results/gpu_smoke.json            # already installed

Cases (`CASES`): the default digits job on cuda (with DeepSpeed's fused Adam), tiny random SD1.5-, SDXL-, SD3- and
FLUX-style pipelines with LoRA, a dLLM preset on a tiny LLaDA with LoRA; and two checks: DeepSpeed's fused Adam
against torch's AdamW, and a single-rank NCCL process group (an all-reduce and the weight broadcast's flat buffers).
Each model case runs in two processes:

    cpu   builds the case (tiny models under the work folder) and records its first step on the CPU, per dtype
    cuda  the same first step on the GPU from the same seed and weights, compared with the CPU's
          (benchmarks/gpu_parity.py: rollout and recomputed log-probs, loss, gradient norm, recompute alarm,
          one weight sync), then a few steps of `steadyrl train --local` for step time, samples/s and peak memory

Without a CUDA device the cpu processes still run (the script's CPU half: the wheels installed, every case built
and stepped) and every GPU part is reported "skipped", never "passed". A case passes only when each of its
GPU parts ran and held.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "gpu_smoke.json"
MARK = "SMOKE-RESULT "  # the line a phase process prints its result on
CPU_ONLY = ["ray.rollout_gpus=0", "ray.learner_gpus=0", "learner.backend=gloo"]
ON_GPU = ["ray.rollout_gpus=1", "ray.learner_gpus=1", "learner.backend=nccl"]
PACKAGES = ("torch", "diffusers", "deepspeed", "transformers", "peft", "pydantic", "safetensors", "steadyrl", "ray")


@dataclass(frozen=True)
class Case:
    """A model case: a preset (or none: a tiny pipeline), the tiny model it is built on, the dtypes whose first
    step is compared, the dtype it trains in, and settings it adds on the GPU."""

    name: str
    config: str | None
    tiny: str | None
    dtypes: tuple[str, ...]
    train_dtype: str
    gpu_overrides: tuple[str, ...] = ()
    what: str = ""


CASES = {c.name: c for c in [
    Case("digits", "configs/digits-grpo.yaml", None, ("float32",), "float32", ("learner.fused_adam=true",),
         "the default job (DDIM, class-conditional UNet), DeepSpeed's fused Adam"),
    Case("sd15", None, "sd", ("float32", "bfloat16"), "bfloat16", (), "SD1.5-style UNet pipeline, DDIM, LoRA"),
    Case("sdxl", None, "sdxl", ("float32", "bfloat16"), "bfloat16", (), "SDXL-style pipeline, DDIM, LoRA"),
    Case("sd3", None, "sd3", ("float32", "bfloat16"), "bfloat16", (), "SD3-style transformer, flow SDE, LoRA"),
    Case("flux", None, "flux", ("float32", "bfloat16"), "bfloat16", (), "FLUX-style transformer, flow SDE, LoRA"),
    Case("llada", "configs/llada-gsm8k-bgpo.yaml", "llada", ("float32", "bfloat16"), "bfloat16", (),
         "BGPO on a tiny LLaDA, masked-diffusion sampler, LoRA"),
]}
CHECKS = {"fused_adam": "DeepSpeed's FusedAdam (compiled with nvcc) against torch.optim.AdamW, 5 steps",
          "nccl": "a single-rank NCCL process group: all-reduce, and the weight broadcast's flat buffers"}
#: a first step small enough for a CPU reference in seconds (the training run keeps the case's own sizes)
PARITY_SIZES = {**{n: ["testbed.prompts.prompts_per_step=2", "sampler.group_size=4"] for n in ("sd15", "sdxl", "sd3",
                                                                                             "flux")},
                "digits": ["sampler.group_size=4"]}
FUSED_ADAM_TOL = 1e-5  # max |fused - torch| / max(1, |torch|) over the parameters after 5 steps (float32)


# ------------------------------------------------------------------ the phases (each in its own process)
def case_overrides(case: Case, work: Path, dtype: str) -> list[str]:
    """The case's settings for `dtype` (its tiny models built under `work` on first use), one optimiser step."""
    from benchmarks.gpu_check import tiny_llada_overrides, tiny_overrides
    from benchmarks.gpu_parity import one_update_overrides

    saved = work / "overrides.json"
    if not saved.exists():
        work.mkdir(parents=True, exist_ok=True)
        tiny = (tiny_llada_overrides(work) if case.tiny == "llada" else tiny_overrides(case.tiny, work)
                if case.tiny else [])
        saved.write_text(json.dumps(tiny))
    tiny = json.loads(saved.read_text())
    small = [*tiny, *([f"testbed.dtype={dtype}"] if case.tiny else []), *PARITY_SIZES.get(case.name, [])]
    return [*small, *one_update_overrides(samples_per_step(case, small))]


def samples_per_step(case: Case, overrides: list[str]) -> int:
    from benchmarks.gpu_check import samples_per_step as count
    from steadyrl.services.config import load_config

    return count(load_config(preset(case), overrides))


def preset(case: Case) -> Path | None:
    return ROOT / case.config if case.config else None


def run_cpu_phase(case: Case, work: Path) -> dict[str, Any]:
    """Build the case and record its first step on the CPU for every dtype it compares (`<dtype>.pt`)."""
    import torch

    from benchmarks.gpu_parity import first_step
    from steadyrl.services.config import load_config

    out: dict[str, Any] = {}
    for dtype in case.dtypes:
        t0 = time.perf_counter()
        cfg = load_config(preset(case), [*case_overrides(case, work, dtype), *CPU_ONLY])
        ref = first_step(cfg, "cpu")
        torch.save(ref, work / f"cpu_{dtype}.pt")
        out[dtype] = {"seconds": time.perf_counter() - t0, "alarm": ref["alarm"], "loss": ref["loss"],
                      "grad_norm": ref["grad_norm"], "sync_equal": ref["sync"]["equal"]}
        if ref["alarm"] or not ref["sync"]["equal"]:
            raise AssertionError(f"the CPU reference itself is off ({dtype}): alarm {ref['alarm']}, weight sync "
                                 f"equal {ref['sync']['equal']}")
    return out


def run_device_phase(case: Case, work: Path, steps: int, device: str = "cuda") -> dict[str, Any]:
    """The first step on `device` (the GPU; the tests give "cpu" to check the harness) against the CPU's, per
    dtype, then `steps` steps of the loop for its figures."""
    import torch

    from benchmarks.gpu_check import check
    from benchmarks.gpu_parity import compare, first_step
    from steadyrl.services.config import load_config

    parity = {}
    for dtype in case.dtypes:
        devices = ON_GPU if device == "cuda" else CPU_ONLY
        cfg = load_config(preset(case), [*case_overrides(case, work, dtype), *devices])
        ref = torch.load(work / f"cpu_{dtype}.pt", weights_only=False)
        parity[dtype] = compare(first_step(cfg, device, reference=ref["batch"]), ref, dtype)
    tiny = json.loads((work / "overrides.json").read_text())
    dtype_setting = [f"testbed.dtype={case.train_dtype}"] if case.tiny else []
    gpu_only = case.gpu_overrides if device == "cuda" else ()
    train = check(case.config, [*tiny, *dtype_setting, *devices, *gpu_only], steps)
    train["ok"] = bool(train["finite"])
    return {"parity": parity, "train": train}


def run_fused_adam() -> dict[str, Any]:
    """FusedAdam (AdamW mode) and torch's AdamW from the same parameters and gradients, 5 steps."""
    import torch

    from steadyrl.rollout.cache import torch_extensions_dir
    from steadyrl.trainer.deepspeed_config import fused_adam_build_env

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(torch_extensions_dir()))  # where the learner finds it compiled
    os.environ.update(fused_adam_build_env(os.environ))  # as the learner builds it
    from deepspeed.ops.adam import FusedAdam

    gen = torch.Generator().manual_seed(0)
    shapes = [(257, 129), (1000,), (3, 64, 3, 3)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    grads = [[torch.randn(s, generator=gen) for s in shapes] for _ in range(5)]
    t0 = time.perf_counter()
    fused_params = [p.clone().cuda().requires_grad_() for p in start]
    torch_params = [p.clone().cuda().requires_grad_() for p in start]
    opts = [FusedAdam(fused_params, lr=1e-2, weight_decay=0.01, adam_w_mode=True),
            torch.optim.AdamW(torch_params, lr=1e-2, weight_decay=0.01)]
    build_s = time.perf_counter() - t0
    for step in grads:
        for params, opt in zip((fused_params, torch_params), opts):
            for p, g in zip(params, step):
                p.grad = g.cuda()
            opt.step()
    error = max(float(((a - b).abs() / b.abs().clamp(min=1)).max()) for a, b in zip(fused_params, torch_params))
    return {"ok": error <= FUSED_ADAM_TOL, "error": error, "tolerance": FUSED_ADAM_TOL, "build_s": build_s}


def run_nccl() -> dict[str, Any]:
    """A one-rank NCCL group: an all-reduce leaves the tensor as it was; the weight broadcast (trainer/
    weight_broadcast.py) sends a state's flat per-dtype buffers and reports their bytes."""
    import torch
    import torch.distributed as dist

    from steadyrl.rollout.weight_broadcast import WeightBroadcastGroup
    from steadyrl.services.runtime.rank_env import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, is_master=True)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        x = torch.arange(1024, dtype=torch.float32, device="cuda")
        y = x.clone()
        dist.all_reduce(y)
        torch.cuda.synchronize()
        state = {"a.weight": torch.randn(64, 32), "b.bias": torch.randn(64).bfloat16()}
        group = WeightBroadcastGroup("127.0.0.1", free_port(), 0, 1, backend="nccl")
        sent = group.broadcast(state)
        torch.cuda.synchronize()
        expected = sum(v.numel() * v.element_size() for v in state.values())
        return {"ok": torch.equal(x, y) and sent == expected, "all_reduce_equal": torch.equal(x, y),
                "broadcast_bytes": sent, "expected_bytes": expected}
    finally:
        dist.destroy_process_group()


def phase_main(args: argparse.Namespace) -> None:
    """One phase in this process; its result is printed as one `MARK` line."""
    t0 = time.perf_counter()
    try:
        if args.phase in CHECKS:
            result = {"fused_adam": run_fused_adam, "nccl": run_nccl}[args.phase]()
        elif args.phase == "cpu":
            result = run_cpu_phase(CASES[args.case], args.work)
        else:
            result = run_device_phase(CASES[args.case], args.work, args.steps)
        result = {"status": "ran", **result}
    except Exception as err:  # noqa: BLE001 - the phase's failure is its result; the log keeps the traceback
        import traceback

        traceback.print_exc()
        result = {"status": "error", "error": f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"}
    result["seconds"] = time.perf_counter() - t0
    print(MARK + json.dumps(result, default=float), flush=True)


# ------------------------------------------------------------------ the orchestrator
@dataclass
class Phase:
    """A phase process's outcome: its result line (or why there is none; a failure carries its log's tail), and its
    time."""

    result: dict[str, Any]
    seconds: float


def spawn(phase: str, case: str | None, work: Path, timeout_s: float, steps: int, threads: int,
          deadline: float = float("inf")) -> Phase:
    """Run one phase in a fresh Python under `timeout_s`, ending by `deadline` (time.monotonic()) at the latest;
    a crash, a hang or a missing result is its result."""
    timeout_s = min(timeout_s, deadline - time.monotonic())
    if timeout_s < 10:
        return Phase({"status": "error", "error": "not started: the run's --budget was spent"}, 0.0)
    work.mkdir(parents=True, exist_ok=True)
    log = work / f"{phase}.log"
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **os.environ,  # as `steadyrl` itself runs
           "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads)}
    if phase == "cpu":  # the CPU reference never touches the GPU, and DeepSpeed picks its CPU accelerator
        env.update(CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")
    else:
        env["DS_ACCELERATOR"] = "cuda"
    cmd = [sys.executable, "-m", "benchmarks.gpu_smoke", "--phase", phase, "--work", str(work), "--steps", str(steps),
           *(["--case", case] if case else [])]
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=fh, text=True,
                                  timeout=timeout_s)
            out, code = proc.stdout, proc.returncode
        except subprocess.TimeoutExpired as err:
            out, code = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or ""), None
        fh.write(out)
    lines = [line[len(MARK):] for line in out.splitlines() if line.startswith(MARK)]
    if lines:
        result = json.loads(lines[-1])
    elif code is None:
        result = {"status": "error", "error": f"timed out after {timeout_s:.0f} s"}
    else:
        result = {"status": "error", "error": f"the process exited with status {code} without a result"}
    if result["status"] == "error":
        result["log_tail"] = log.read_text(errors="replace").splitlines()[-25:]
    return Phase(result, time.perf_counter() - t0)


def environment() -> dict[str, Any]:
    """The device, Python and the versions of the packages the cases use (`ray`: None where it is absent)."""
    from importlib import metadata

    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    cuda = torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "cuda": cuda,
            "cuda_version": torch.version.cuda, "python": platform.python_version(),
            "cpu_count": os.cpu_count(), "packages": versions}


def case_status(cpu: dict[str, Any], gpu: dict[str, Any] | None) -> tuple[str, str]:
    """passed only when the GPU part ran and every check held; skipped without a GPU; failed otherwise."""
    if cpu["status"] != "ran":
        return "failed", f"CPU reference: {cpu['error']}"
    if gpu is None:
        return "skipped", "no CUDA device: the CPU reference ran, the GPU part did not"
    if gpu["status"] != "ran":
        return "failed", gpu["error"]
    bad = [f"{dtype} {k}" for dtype, p in gpu["parity"].items() for k, v in p.items() if k != "ok" and not v["ok"]]
    if not gpu["train"]["ok"]:
        bad.append("training steps not finite")
    return ("failed", "; ".join(bad)) if bad else ("passed", "")


def smoke(cases: list[str], checks: list[str], out: Path, work: Path, steps: int, timeout_s: float,
          jobs: int, budget_s: float = float("inf")) -> dict[str, Any]:
    """Every case and check, all ended within `budget_s`; the JSON written to `out` (also after each case, so a
    killed run keeps its part)."""
    deadline = time.monotonic() + budget_s
    env = environment()
    gpu = env["cuda"]
    threads = max(1, (os.cpu_count() or 1) // max(1, jobs))
    report: dict[str, Any] = {**env, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "steps": steps, "case_timeout_s": timeout_s, "budget_s": budget_s, "cases": []}
    t0 = time.perf_counter()

    def save() -> None:
        report["wall_s"] = time.perf_counter() - t0
        report["summary"] = {s: sum(c["status"] == s for c in report["cases"]) for s in ("passed", "failed", "skipped")}
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=1, default=float))
        tmp.replace(out)

    for name in checks:  # the fused-Adam op compiles first: the digits case trains with it
        if not gpu:
            report["cases"].append({"case": name, "status": "skipped", "what": CHECKS[name], "reason": "no CUDA device"})
        else:
            ph = spawn(name, None, work / name, timeout_s, steps, threads, deadline)
            ok = ph.result["status"] == "ran" and ph.result["ok"]
            report["cases"].append({**ph.result, "case": name, "what": CHECKS[name],  # its "status" is the phase's
                                    "status": "passed" if ok else "failed",
                                    "reason": "" if ok else ph.result.get("error", "the check did not hold"),
                                    "seconds": ph.seconds})
        save()
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        refs: dict[str, Future] = {n: pool.submit(spawn, "cpu", n, work / n, timeout_s, steps, threads, deadline)
                                   for n in cases}
        for name in cases:  # GPU phases one at a time, each as soon as its CPU reference is there
            cpu = refs[name].result()
            gpu_phase = spawn("cuda", name, work / name, timeout_s, steps, threads, deadline) \
                if gpu and cpu.result["status"] == "ran" else None
            status, reason = case_status(cpu.result, gpu_phase.result if gpu_phase else None)
            row = {"case": name, "what": CASES[name].what, "status": status, "reason": reason,
                   "cpu_reference": cpu.result, "seconds": cpu.seconds + (gpu_phase.seconds if gpu_phase else 0.0)}
            if gpu_phase is not None:
                row["gpu"] = gpu_phase.result
            report["cases"].append(row)
            save()
    return report


def summary_table(report: dict[str, Any]) -> Any:
    """One screen: a row per case, its status, the worst parity error against its tolerance, and its figures."""
    from rich.table import Table

    table = Table(title=f"steadyrl GPU smoke on {report['device']} ({report['wall_s']:.0f} s)")
    for col in ("case", "status", "worst parity (error / tol)", "step s", "samples/s", "peak GB", "note"):
        table.add_column(col, justify="right" if col in ("step s", "samples/s", "peak GB") else "left")
    colour = {"passed": "green", "failed": "red", "skipped": "yellow"}
    for c in report["cases"]:
        gpu = c.get("gpu") or {}
        worst, train = "", gpu.get("train") or {}
        checks = [(f"{d} {k}", v) for d, p in (gpu.get("parity") or {}).items() for k, v in p.items() if k != "ok"]
        scored = [(n, v) for n, v in checks if v["tolerance"] > 0]
        if scored:
            n, v = max(scored, key=lambda nv: nv[1]["error"] / nv[1]["tolerance"])
            worst = f"{n}: {v['error']:.1e} / {v['tolerance']:.0e}"
        elif "error" in c and "tolerance" in c:
            worst = f"{c['error']:.1e} / {c['tolerance']:.0e}"
        peak = train.get("peak_gpu_memory_gb")
        table.add_row(c["case"], f"[{colour[c['status']]}]{c['status']}[/]", worst,
                      f"{train['step_s']:.2f}" if train else "", f"{train['samples_per_s']:.1f}" if train else "",
                      f"{peak:.2f}" if peak is not None else "", c.get("reason", "")[:60])
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS, help="the JSON (default benchmarks/results/gpu_smoke.json)")
    parser.add_argument("--work", type=Path, default=None, help="tiny models, CPU references and per-phase logs "
                        "(default: a folder beside --out)")
    parser.add_argument("--cases", default=",".join([*CHECKS, *CASES]),
                        help=f"comma-separated, of {', '.join([*CHECKS, *CASES])}")
    parser.add_argument("--steps", type=int, default=3, help="steps of each case's training run on the GPU")
    parser.add_argument("--case-timeout", type=float, default=240.0, help="seconds each phase process may take")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds the whole run may take: a phase "
                        "ends by then, and one that cannot start in time fails saying so (default 540: one "
                        "10-minute command with time to install)")
    parser.add_argument("--jobs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                        help="CPU references built at once (they run beside the GPU phases)")
    parser.add_argument("--phase", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        return phase_main(args)
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = sorted(set(chosen) - set(CASES) - set(CHECKS))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {[*CHECKS, *CASES]}")
    work = args.work or args.out.parent / (args.out.stem + "_work")
    report = smoke([c for c in CASES if c in chosen], [c for c in CHECKS if c in chosen], args.out, work, args.steps,
                   args.case_timeout, args.jobs, args.budget)
    from rich.console import Console

    console = Console(width=max(120, Console().width))
    console.print(summary_table(report))
    s = report["summary"]
    console.print(f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped   JSON: {args.out}   logs: {work}",
                  soft_wrap=True, highlight=False)
    sys.exit(1 if s["failed"] else 0)


if __name__ == "__main__":
    main()
