"""BGPO's memory claim: peak memory and time of one update against the number n of MC samples.

    python benchmarks/bgpo_memory.py [--batch 16] [--prompt 32] [--gen 96] [--ns 1 4 16] [--repeats 3]
                                     [--device auto|cpu|cuda] [--out benchmarks/results/bgpo_memory]

One "update" is the forward and backward pass(es) of the policy objective for one batch of B sequences
(prompt P + completion L tokens) on a masked LM (transformers BERT, hidden 256, 4 layers, 4 heads, MLP
1024; ~3.3 M parameters, so activations dominate). With ell_j the elbo estimate of log pi(y|x) on MC mask
j (rollout/likelihood.py, `reduce="mean"`, the masks stored in the batch as MaskedDiffusionSampler
stores them), old_j the same at theta_old, ell_bar = mean_j ell_j, old_bar = mean_j old_j, A the
advantage (random signs) and sg = stop-gradient, the three forms of the same update are

  (i)   naive      L = -mean_i A_i exp(ell_bar_i - old_bar_i)                       one backward, all n
                                                                                    graphs alive at once
  (ii)  two-pass   ell_bar from a no-grad pass; then for each j in turn
                   L_j = -mean_i A_i exp(sg(ell_bar_i) + (ell_ij - sg(ell_ij)) / n - old_bar_i),
                   backward, free                       (value of (i), gradient sum_j = gradient of (i);
                                                         trainer/terms.py `SequenceTerms`)
  (iii) BGPO       for each j in turn L_j = -mean_i bgpo_bound(ell_ij - old_ij, A_i) / n, backward, free
                   bgpo_bound(d, A) = A (1 + d) for A >= 0, A exp(d) for A < 0  (trainer/objectives/bgpo.py)

(i) and (ii) have the same gradient at any theta; (iii) has it at theta = theta_old (shared masks). The
script asserts both on a small batch before it measures anything (gradients compared with allclose).

Measurement. Every (form, n) runs in a fresh subprocess (this file with `--worker FORM N`, one torch
thread) which builds the model (fixed seed) and a synthetic batch (random prompt and completion ids over
the arith vocabulary, masks from `draw_masks("elbo", B, n, L, P, 0.0, gen)`, old_logp from a no-grad
pass: theta = theta_old), runs the form once on a 2-row slice (lazy initialisation), and then, with the
gradients set to None before every update (each update allocates them, as after `zero_grad()`):

  CPU   1. RSS (the OS's view): the peak RSS during one full update minus the RSS just before it
           (/proc/self/statm), read after gc and glibc malloc_trim(0) so that freed heap is returned
           first. The peak is VmHWM (/proc/self/status), reset to the current RSS just before the update
           by writing 5 to /proc/self/clear_refs (Linux >= 4.0): importing torch and transformers leaves
           a lifetime peak (ru_maxrss) above what a small update needs. Where the reset is refused, the
           lifetime peak is used and the number is the update's only if it rose (`rss_valid`). Includes
           what glibc malloc keeps of freed memory (fragmentation; see "RSS and malloc" below).
        2. allocator peak (the reported number, `peak_mb`): a second update under torch.profiler with
           profile_memory=True, which records every allocation and free of torch's CPU allocator (size,
           time); the peak is the maximum of their running sum, i.e. the peak of live tensor bytes above
           what was live before the update. Exact and deterministic (torch does not cache CPU memory, no
           OS noise). It reads the profiler's event tree (`kineto_results.experimental_event_tree()`, a
           semi-private API); if that fails the field is null and `peak_mb` falls back to RSS. RSS is not
           read under the profiler: its event records add hundreds of MB that grow with n.
  CUDA  torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus memory_allocated()
        before the update (the caching allocator's view of live tensors, the standard GPU number).

Time: the median of `--repeats` further updates in the same subprocess (after the measured ones, so
warm), without the profiler; on CUDA with synchronisation.

RSS and malloc: with glibc's default dynamic mmap threshold, the per-sample loops of (ii) and (iii) leave
freed activation memory in malloc's heap, so their RSS peak creeps up with n although live tensor memory
does not. Run with MALLOC_MMAP_THRESHOLD_=65536 in the environment (the workers inherit it) and large
blocks are mmap'd and returned on free: RSS then follows the allocator peak (timings may differ).

Writes to --out (default benchmarks/results/bgpo_memory; benchmarks/results/bgpo_memory_cuda on a GPU):
results.json (settings, machine, per-(form, n) peak MB and seconds, each form's n=max / n=min memory and
time ratios), table.md, memory.png (peak memory vs n and time vs n, one line per form).
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch

from steadyrl.rollout.arith import SPECIALS, TOKENIZER
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import MaskedDiffusionSamplerConfig
from steadyrl.rollout.likelihood import draw_masks
from steadyrl.rollout.masked_diffusion import MaskedDiffusionSampler
from steadyrl.rollout.masked_lm import MaskedLMConfig, build_masked_lm
from steadyrl.trainer.objectives.bgpo import bgpo_bound

FORMS = ("naive", "two_pass", "bgpo")
LABELS = {"naive": "(i) naive single graph", "two_pass": "(ii) exact, two passes", "bgpo": "(iii) BGPO bound"}
MODEL = MaskedLMConfig(hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024, max_positions=160)
MB = 2**20


# ----------------------------------------------------------------------------------------------- set-up
def build(batch_size: int, prompt_len: int, gen_len: int, n: int, seed: int, device: torch.device,
          model_cfg: MaskedLMConfig = MODEL) -> tuple[torch.nn.Module, MaskedDiffusionSampler, RolloutBatch]:
    """The model (seeded), the sampler and a synthetic batch with stored masks and old_logp = theta's."""
    torch.manual_seed(seed)
    model = build_masked_lm(model_cfg, len(TOKENIZER)).to(device).train()  # no dropout in this config
    sampler = MaskedDiffusionSampler(MaskedDiffusionSamplerConfig(
        gen_length=gen_len, num_steps=gen_len, mc_samples=n, estimator="elbo"), TOKENIZER.mask_token_id,
        TOKENIZER.eos_id, TOKENIZER.pad_id)
    gen = torch.Generator().manual_seed(seed + 1)
    B, P, L = batch_size, prompt_len, gen_len
    first = len(SPECIALS)  # character ids only (after <pad>, <mask>, <eos>)
    prompts = torch.randint(first, len(TOKENIZER), (B, P), generator=gen)
    completion = torch.randint(first, len(TOKENIZER), (B, L), generator=gen)
    masks = draw_masks("elbo", B, n, L, P, 0.0, gen)
    adv = torch.randn(B, generator=gen)  # random signs: both branches of the BGPO bound
    batch = RolloutBatch(cond=prompts, group=torch.arange(B) // 8, samples=completion, traj=completion.unsqueeze(1),
                         old_logp=torch.zeros(B, n), timesteps=sampler.timesteps.clone(),
                         trainable=sampler.trainable.clone(), advantages=adv,
                         extras={"mc_masks": masks.completion, "prompt_masks": masks.prompt}).to(device=device)
    with torch.no_grad():
        old = torch.stack([sampler.log_prob(model, batch, j).logp for j in range(n)], dim=1)
    return model, sampler, batch.replace(old_logp=old)


# ----------------------------------------------------------------------------------------- the three forms
def update_naive(model, sampler: MaskedDiffusionSampler, batch: RolloutBatch) -> float:
    """(i): every MC sample's graph alive at once, one backward."""
    n = batch.old_logp.shape[1]
    ell = torch.stack([sampler.log_prob(model, batch, j).logp for j in range(n)], dim=1)
    loss = -(batch.advantages * torch.exp(ell.mean(1) - batch.old_logp.mean(1))).mean()
    loss.backward()
    return float(loss.detach())


def update_two_pass(model, sampler: MaskedDiffusionSampler, batch: RolloutBatch) -> float:
    """(ii): a no-grad pass for ell_bar, then one backward per MC sample of the linearised piece."""
    n = batch.old_logp.shape[1]
    with torch.no_grad():
        ell_bar = torch.stack([sampler.log_prob(model, batch, j).logp for j in range(n)], dim=1).mean(1)
    old_bar = batch.old_logp.mean(1)
    total = 0.0
    for j in range(n):
        ell_j = sampler.log_prob(model, batch, j).logp
        piece = ell_bar + (ell_j - ell_j.detach()) / n
        loss = -(batch.advantages * torch.exp(piece - old_bar)).mean()
        loss.backward()
        total = float(loss.detach())  # every piece has the exact objective's value
    return total


def update_bgpo(model, sampler: MaskedDiffusionSampler, batch: RolloutBatch) -> float:
    """(iii): BGPO's bound, a sum of per-MC-sample terms, one backward per term."""
    n = batch.old_logp.shape[1]
    total = 0.0
    for j in range(n):
        ell_j = sampler.log_prob(model, batch, j).logp
        loss = -bgpo_bound(ell_j - batch.old_logp[:, j], batch.advantages).mean() / n
        loss.backward()
        total += float(loss.detach())
    return total


UPDATES: dict[str, Callable[..., float]] = {"naive": update_naive, "two_pass": update_two_pass, "bgpo": update_bgpo}


def gradient(model, update: Callable[..., float], sampler, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    update(model, sampler, batch)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def check_equivalence(n: int = 4, batch_size: int = 4, prompt_len: int = 32, gen_len: int = 96) -> dict[str, float]:
    """Assert (i) == (ii) in gradient at theta != theta_old, and (i) == (ii) == (iii) at theta = theta_old."""
    model, sampler, batch = build(batch_size, prompt_len, gen_len, n, seed=123, device=torch.device("cpu"))
    out: dict[str, float] = {}

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    def close(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))

    g = {f: gradient(model, UPDATES[f], sampler, batch) for f in FORMS}  # theta = theta_old
    assert close(g["two_pass"], g["naive"]), f"(ii) != (i) at theta_old: rel. diff {rel(g['two_pass'], g['naive']):.2e}"
    assert close(g["bgpo"], g["naive"]), f"(iii) != (i) at theta_old: rel. diff {rel(g['bgpo'], g['naive']):.2e}"
    out["at_theta_old/two_pass_vs_naive"] = rel(g["two_pass"], g["naive"])
    out["at_theta_old/bgpo_vs_naive"] = rel(g["bgpo"], g["naive"])
    shifted = batch.replace(old_logp=batch.old_logp + 0.2 * torch.randn(batch.old_logp.shape,
                                                                        generator=torch.Generator().manual_seed(5)))
    g = {f: gradient(model, UPDATES[f], sampler, shifted) for f in FORMS}  # theta != theta_old (ratios != 1)
    assert close(g["two_pass"], g["naive"]), f"(ii) != (i) off-policy: rel. diff {rel(g['two_pass'], g['naive']):.2e}"
    out["off_policy/two_pass_vs_naive"] = rel(g["two_pass"], g["naive"])
    out["off_policy/bgpo_vs_naive"] = rel(g["bgpo"], g["naive"])  # a bound, not the same update here: info only
    return out


# ------------------------------------------------------------------------------------------ measurement
def current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def max_rss() -> int:
    """Peak RSS in bytes: VmHWM (resettable, see `reset_max_rss`), else the lifetime ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def reset_max_rss() -> bool:
    """Reset the peak RSS (VmHWM) to the current RSS (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def release_memory() -> None:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def allocator_peak(prof) -> float | None:
    """Peak of the running sum of the CPU allocations/frees the profiler recorded, in bytes (None if unreadable)."""
    try:
        from torch._C._profiler import _EventType

        events: list[tuple[int, int]] = []
        stack = list(prof.profiler.kineto_results.experimental_event_tree())
        while stack:
            e = stack.pop()
            if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
                events.append((e.start_time_ns, e.extra_fields.alloc_size))
            stack.extend(e.children)
        events.sort()
        live = peak = 0
        for _, size in events:
            live += size
            peak = max(peak, live)
        return float(peak) if events else None
    except Exception:  # noqa: BLE001 - a semi-private API: fall back to RSS
        return None


def worker(form: str, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One (form, n) in this (fresh) process: peak memory of one update, then the median time of `repeats`."""
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model, sampler, batch = build(args.batch, args.prompt, args.gen, n, args.seed, device)
    update = UPDATES[form]
    update(model, sampler, batch.index(slice(0, 2)))  # lazy initialisation on a tiny slice
    model.zero_grad(set_to_none=True)
    out: dict[str, Any] = {"form": form, "n": n}
    if device.type == "cuda":
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out["loss"] = update(model, sampler, batch)
        torch.cuda.synchronize()
        out["peak_mb"] = (torch.cuda.max_memory_allocated() - base) / MB
        out["method"] = "cuda.max_memory_allocated"
    else:
        from torch.profiler import ProfilerActivity, profile

        release_memory()
        out["rss_peak_reset"] = reset_max_rss()
        rss0, max0 = current_rss(), max_rss()
        out["loss"] = update(model, sampler, batch)  # RSS: without the profiler, whose event records weigh
        max1 = max_rss()
        out["rss_peak_mb"] = (max1 - rss0) / MB
        out["rss_valid"] = max1 > max0
        out["rss_before_mb"], out["maxrss_before_mb"], out["maxrss_after_mb"] = rss0 / MB, max0 / MB, max1 / MB
        model.zero_grad(set_to_none=True)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            update(model, sampler, batch)
        peak = allocator_peak(prof)
        del prof
        out["allocator_peak_mb"] = None if peak is None else peak / MB
        out["peak_mb"] = out["allocator_peak_mb"] if peak is not None else out["rss_peak_mb"]
        out["method"] = "cpu allocator (torch.profiler)" if peak is not None else "rss"
    times = []
    for _ in range(args.repeats):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        update(model, sampler, batch)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    out["times_s"] = times
    out["seconds"] = statistics.median(times)
    return out


# ------------------------------------------------------------------------------------------------ report
def markdown_table(rows: list[dict[str, Any]], ns: list[int], ratios: dict[str, dict[str, float]], setting: str,
                   cpu: bool) -> str:
    lines = [setting, ""]
    head = "| form | " + " | ".join(f"n={n} peak MB" for n in ns) + f" | mem n={ns[-1]}/n={ns[0]} | " + \
        " | ".join(f"n={n} s" for n in ns) + f" | time n={ns[-1]}/n={ns[0]} |"
    lines += [head, "|---" * (2 * len(ns) + 3) + "|"]
    for form in FORMS:
        by_n = {r["n"]: r for r in rows if r["form"] == form}
        lines.append(f"| {LABELS[form]} | " + " | ".join(f"{by_n[n]['peak_mb']:.1f}" for n in ns)
                     + f" | {ratios[form]['memory']:.2f} | " + " | ".join(f"{by_n[n]['seconds']:.2f}" for n in ns)
                     + f" | {ratios[form]['time']:.2f} |")
    if cpu:
        note = ("RSS cross-check (peak RSS, VmHWM reset before the update, minus the RSS just before it, MB; "
                "* = the peak did not rise during the update, so the number is not the update's):")
        lines += ["", note, "",
                  "| form | " + " | ".join(f"n={n}" for n in ns) + f" | n={ns[-1]}/n={ns[0]} |",
                  "|---" * (len(ns) + 2) + "|"]
        for form in FORMS:
            by_n = {r["n"]: r for r in rows if r["form"] == form}
            lines.append(f"| {LABELS[form]} | " + " | ".join(
                f"{by_n[n]['rss_peak_mb']:.1f}{'' if by_n[n]['rss_valid'] else '*'}" for n in ns)
                + f" | {ratios[form]['rss']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], ns: list[int], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.8))
    for i, form in enumerate(FORMS):
        by_n = {r["n"]: r for r in rows if r["form"] == form}
        axes[0].plot(ns, [by_n[n]["peak_mb"] for n in ns], "o-", color=f"C{i}", label=LABELS[form])
        axes[1].plot(ns, [by_n[n]["seconds"] for n in ns], "o-", color=f"C{i}", label=LABELS[form])
    axes[0].set_ylabel("peak memory of one update (MB)")
    axes[1].set_ylabel("seconds per update (median)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.set_xlabel("MC samples n")
        ax.grid(alpha=0.3)
    axes[1].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16, help="B sequences per update")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens P")
    ap.add_argument("--gen", type=int, default=96, help="completion tokens L")
    ap.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16], help="MC sample counts")
    ap.add_argument("--repeats", type=int, default=3, help="timed updates per (form, n); the median is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", nargs=2, metavar=("FORM", "N"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.worker:
        print(json.dumps(worker(args.worker[0], int(args.worker[1]), args)))
        return

    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    torch.set_num_threads(1)
    out = Path(args.out or ("benchmarks/results/bgpo_memory" if args.device == "cpu"
                            else "benchmarks/results/bgpo_memory_cuda"))
    t_start = time.perf_counter()
    check = check_equivalence()
    print("gradient check passed:", ", ".join(f"{k} rel. diff {v:.1e}" for k, v in check.items()), flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    common = ["--batch", str(args.batch), "--prompt", str(args.prompt), "--gen", str(args.gen), "--repeats",
              str(args.repeats), "--seed", str(args.seed), "--device", args.device]
    rows: list[dict[str, Any]] = []
    todo = [(form, n) for form in FORMS for n in args.ns]
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn()) as progress:
        task = progress.add_task("bgpo_memory", total=len(todo))
        for form, n in todo:
            progress.update(task, description=f"{form} n={n}")
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", form, str(n), *common],
                                  capture_output=True, text=True, env=env, cwd=ROOT, check=False)
            if proc.returncode:
                raise RuntimeError(f"worker {form} n={n} failed:\n{proc.stderr[-4000:]}")
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            progress.console.print(f"{form:9s} n={n:3d}: peak {row['peak_mb']:8.1f} MB"
                                   + (f" (RSS {row['rss_peak_mb']:.1f} MB)" if "rss_peak_mb" in row else "")
                                   + f", {row['seconds']:.2f} s")
            progress.advance(task)
    lo, hi = args.ns[0], args.ns[-1]

    def at(form: str, n: int) -> dict[str, Any]:
        return next(r for r in rows if r["form"] == form and r["n"] == n)

    ratios: dict[str, dict[str, float]] = {}
    for form in FORMS:
        ratios[form] = {"memory": at(form, hi)["peak_mb"] / at(form, lo)["peak_mb"],
                        "time": at(form, hi)["seconds"] / at(form, lo)["seconds"]}
        if args.device == "cpu":
            ratios[form]["rss"] = at(form, hi)["rss_peak_mb"] / at(form, lo)["rss_peak_mb"]
    comparisons = {f"n={n}": {"two_pass_over_bgpo_memory": at("two_pass", n)["peak_mb"] / at("bgpo", n)["peak_mb"],
                              "two_pass_over_bgpo_time": at("two_pass", n)["seconds"] / at("bgpo", n)["seconds"],
                              "naive_over_bgpo_memory": at("naive", n)["peak_mb"] / at("bgpo", n)["peak_mb"],
                              "naive_over_bgpo_time": at("naive", n)["seconds"] / at("bgpo", n)["seconds"]}
                   for n in args.ns}
    claims = {"bgpo_flat_within_10pct": ratios["bgpo"]["memory"] <= 1.10,
              "two_pass_flat_within_10pct": ratios["two_pass"]["memory"] <= 1.10,
              "naive_grows": ratios["naive"]["memory"] > 1.10}
    n_params = sum(p.numel() for p in build_masked_lm(MODEL, len(TOKENIZER)).parameters())
    settings = {"batch": args.batch, "prompt_tokens": args.prompt, "completion_tokens": args.gen, "ns": args.ns,
                "repeats": args.repeats, "seed": args.seed, "estimator": "elbo", "logp_reduce": "mean",
                "model": {**MODEL.model_dump(), "parameters": n_params, "vocab": len(TOKENIZER)},
                "memory_method": rows[0]["method"], "gradients": "set to None before each update (allocated inside it)"}
    machine = {"torch": torch.__version__, "python": platform.python_version(), "threads": 1,
               "device": args.device if args.device == "cpu" else torch.cuda.get_device_name(0),
               "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
               "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")}}
    setting = (f"One update (forward + backward) of B={args.batch} sequences ({args.prompt} prompt + {args.gen} "
               f"completion tokens), masked LM {n_params / 1e6:.1f} M params, elbo estimator; "
               f"device {machine['device']}, 1 thread, torch {torch.__version__}; memory: {rows[0]['method']} "
               f"(peak above the memory live before the update); time: median of {args.repeats}.")
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(rows, args.ns, ratios, setting, args.device == "cpu")
    table += (f"\nBGPO memory flat within 10% (n={hi} vs n={lo}): {claims['bgpo_flat_within_10pct']}; two-pass: "
              f"{claims['two_pass_flat_within_10pct']}; naive grows: {claims['naive_grows']}. At n={hi} the two-pass "
              f"form takes {comparisons[f'n={hi}']['two_pass_over_bgpo_memory']:.2f}x BGPO's memory and "
              f"{comparisons[f'n={hi}']['two_pass_over_bgpo_time']:.2f}x its time; the naive form "
              f"{comparisons[f'n={hi}']['naive_over_bgpo_memory']:.2f}x and "
              f"{comparisons[f'n={hi}']['naive_over_bgpo_time']:.2f}x.\n")
    (out / "table.md").write_text(table)
    wall = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps({
        "settings": settings, "machine": machine, "gradient_check": check, "results": rows,
        f"ratio_n{hi}_over_n{lo}": ratios, "claims": claims, "comparisons": comparisons, "wall_s": wall}, indent=1))
    plot(rows, args.ns, out / "memory.png", f"BGPO memory benchmark: B={args.batch}, {args.prompt}+{args.gen} tokens, "
         f"{machine['device']}, 1 thread")
    print(table)
    print(f"wrote {out}/results.json, table.md, memory.png in {wall:.0f} s")


if __name__ == "__main__":
    main()
