"""Rollout with log-probs against plain inference, text to image: one rollout batch of steadyrl's text-to-image
testbed against the diffusers pipeline's own `__call__` with the same scheduler settings.

    python benchmarks/rollout_overhead_pipelines.py [--repeats 15] [--device cpu|cuda] [--dtype float32] [--threads N] \
        [--real] [--set sampler.num_steps=10 ...] [--out benchmarks/results/rollout_overhead_pipelines.json]

Each preset (sd15: configs/sd15-grpo.yaml, DDIM eta 1, guidance 5, 50 steps, 8 prompts x 16 images; sd35:
configs/sd35-grpo.yaml, the flow SDE, shift 3, guidance 4.5, 10 steps, 4 prompts x 24 images) runs as written
except that its hub model is swapped for a tiny random pipeline of the same architecture (tests/tiny_models.py:
SD1.5's layout without safety checker; SD3's without T5), at the pipeline's native resolution (16 px), in `--dtype`;
the prompts are the preset's own prompt set (animals, scenes). `--real` keeps the preset's own model and resolution
(the hub weights must be in the local cache; with `--dtype bfloat16` as the presets, on a GPU).

- ours:  `Rollouts.generate` (services/runtime/rollouts.py, what a rollout worker runs for one batch) with a scorer that
         returns zeros: the prompts' embeddings (the pipeline's `encode_prompt`, negative prompt included), the
         sampler with classifier-free guidance, every step's Gaussian mean, noise and log-prob and the trajectory
         copied to the CPU, the VAE decode of the final latents (in chunks of `testbed.decode_batch`), the batch's
         rewards attached and its summary; no reward model runs.
- plain: `pipe(prompt, negative_prompt, num_inference_steps, guidance_scale, eta (sd), num_images_per_prompt,
         height, width, generator, output_type="pt")` on the same pipeline object (the same text encoders, VAE
         and denoiser, LoRA adapters included): `encode_prompt`, the scheduler's own loop (`DDIMScheduler.step`
         with eta; SD3: `FlowMatchEulerDiscreteScheduler.step`, the deterministic Euler step, as diffusers has
         no flow SDE), one VAE decode of the whole batch and the image post-processing to [0, 1]. The tiny
         pipelines have no safety checker, and the SD3 one no T5 (zeros stand in for it, as in the real
         pipeline without T5), so neither side runs one.

By default the process keeps freed memory as the product's rollout workers do (`ray.keep_freed_memory`, default
true); `--no-keep-freed-memory` leaves glibc's own adaptive policy. The allocator is the process's, so both sides
run under the same one.

The two alternate within each repeat, each going first in half of the repeats; the first pair is dropped (warm-up).
The JSON holds every time, the median ratio ours / plain, its spread (min..max of the per-repeat ratios) and a 95 %
interval for the median (order statistics, `figures.median_interval`: it narrows with more repeats, the spread does
not), of wall-clock time (the figure; target <= 1.05) and of the process's CPU time (on a GPU it counts only the
host's share).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from figures import median_interval  # noqa: E402
from steadyrl.services.config import RayConfig  # noqa: E402
from steadyrl.services.runtime.malloc import keep_freed_memory  # noqa: E402

PRESETS = {"sd15": ("configs/sd15-grpo.yaml", "save_tiny_sd_pipeline"),
           "sd35": ("configs/sd35-grpo.yaml", "save_tiny_sd3_pipeline")}


def zero_scorer(monitors: list[str]):
    """The reward ensemble's place: zeros for every sample and monitor-only reward (no model runs)."""
    from steadyrl.reward.ensemble import EnsembleScores

    def score(samples, cond, group) -> EnsembleScores:
        zeros = torch.zeros(len(samples))
        return EnsembleScores(names=["zero"], scores=zeros[:, None], mean=zeros, std=zeros, uncertainty=zeros,
                              reward=zeros, train_on="zero", monitors={name: zeros for name in monitors})
    return score


def plain_call(rollouts, prompts: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """diffusers' `__call__` of the pipeline the rollout worker holds, on the same prompts and settings."""
    cfg, tb = rollouts.cfg, rollouts.testbed
    tools = tb.tools(rollouts.policy)
    texts = tb.prompt_texts(prompts)
    kwargs = {"eta": cfg.sampler.eta} if tb.info.family == "sd" else {}
    return tools.pipe(prompt=texts, negative_prompt=[tb.settings.negative_prompt] * len(texts),
                      num_inference_steps=cfg.sampler.num_steps, guidance_scale=tb.settings.guidance_scale,
                      num_images_per_prompt=cfg.sampler.group_size, height=tools.resolution, width=tools.resolution,
                      generator=generator, output_type="pt", **kwargs).images


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(name: str, repeats: int, device: str, dtype: str, overrides: list[str], root: Path | None) -> dict:
    """Both sides on preset `name`, `repeats` pairs after a warm-up pair; a tiny pipeline under `root` (None: the
    preset's own model and resolution)."""
    from safetensors.torch import load_file

    from steadyrl.services.config import load_config
    from steadyrl.services.runtime.rollouts import Rollouts
    from steadyrl.services.testbeds import build_testbed
    from tests import tiny_models

    preset, builder = PRESETS[name]
    model = [] if root is None else [f"testbed.pretrained={getattr(tiny_models, builder)(root / name)}",
                                     "testbed.resolution=null"]
    cfg = load_config(ROOT / preset, [*model, f"testbed.dtype={dtype}", *overrides])
    weights = load_file(str(build_testbed(cfg).base_weights(progress=False)))
    rollouts = Rollouts(cfg, weights, device)
    scorer = zero_scorer(list(cfg.testbed.reward.monitor_only))
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "plain": []}  # (wall, process CPU) seconds
    for r in range(repeats + 1):  # the first pair warms caches and is dropped
        prompts, _ = rollouts.testbed.train_prompts(0, 1, r)
        runs = {"ours": lambda: rollouts.generate(r, 0, 1, scorer)[0],
                "plain": lambda: plain_call(rollouts, prompts, torch.Generator().manual_seed(r))}
        out = {}
        for side in (("ours", "plain") if r % 2 else ("plain", "ours")):  # each side goes first in half the pairs
            sync(device)
            wall, cpu = time.perf_counter(), time.process_time()
            out[side] = runs[side]()
            sync(device)
            if r:
                times[side].append((time.perf_counter() - wall, time.process_time() - cpu))
        assert len(out["ours"]) == len(out["plain"]), (len(out["ours"]), len(out["plain"]))
        batch = out["ours"]
    grid = rollouts.testbed.tools(rollouts.policy).pipe.scheduler.timesteps.cpu().double()
    if not torch.allclose(grid, rollouts.sampler.timesteps.double()):  # the same scheduler settings on both sides
        raise RuntimeError(f"{name}: the pipeline's timesteps {grid.tolist()} differ from the sampler's "
                           f"{rollouts.sampler.timesteps.tolist()}")
    ours_s, plain_s = [w for w, _ in times["ours"]], [w for w, _ in times["plain"]]
    cpu_ratios = [o / p for (_, o), (_, p) in zip(times["ours"], times["plain"])]
    ratios = [o / p for o, p in zip(ours_s, plain_s)]
    tb = rollouts.testbed
    return {"preset": preset, "family": tb.info.family, "sampler": cfg.sampler.kind,
            "steps": cfg.sampler.num_steps, "prompts": len(prompts), "batch": len(batch),
            "guidance_scale": tb.settings.guidance_scale, "eta": getattr(cfg.sampler, "eta", None),
            "shift": getattr(cfg.sampler, "shift", None), "resolution": tb.tools(rollouts.policy).resolution,
            "lora": None if tb.settings.lora is None else tb.settings.lora.model_dump(),
            "ours_s": ours_s, "plain_s": plain_s, "ratio_median": statistics.median(ratios),
            "ratio_min": min(ratios), "ratio_max": max(ratios), "ratio_median_ci95": median_interval(ratios),
            "ours_cpu_s": [c for _, c in times["ours"]], "plain_cpu_s": [c for _, c in times["plain"]],
            "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_min": min(cpu_ratios),
            "cpu_ratio_max": max(cpu_ratios), "cpu_ratio_median_ci95": median_interval(cpu_ratios)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--presets", nargs="+", choices=list(PRESETS), default=list(PRESETS))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--real", action="store_true", help="the presets' own hub models (already in the local Hugging "
                    "Face cache) at their resolution, instead of tiny random pipelines")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="config overrides for every preset (e.g. sampler.num_steps=10 sampler.group_size=4)")
    ap.add_argument("--keep-freed-memory", action=argparse.BooleanOptionalAction,
                    default=RayConfig.model_fields["keep_freed_memory"].default,
                    help="fix glibc's thresholds so freed memory stays in the process, as the product's "
                    "ray.keep_freed_memory does (default: the product's default); --no-...: glibc's adaptive policy")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "rollout_overhead_pipelines.json")
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error("--repeats must be at least 1 (the warm-up pair is dropped)")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    kept = keep_freed_memory() if args.keep_freed_memory else False
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["STEADYRL_CACHE"] = str(Path(tmp) / "cache")  # the tiny pipelines' base weights
        pipelines = {name: measure(name, args.repeats, args.device, args.dtype, args.set,
                                   None if args.real else Path(tmp)) for name in args.presets}
    results = {"torch_threads": torch.get_num_threads(), "keep_freed_memory": kept, "device": args.device,
               "dtype": args.dtype, "real": args.real, "repeats": args.repeats, "overrides": args.set,
               "pipelines": pipelines}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    for name, r in pipelines.items():
        lo, hi = r["ratio_median_ci95"]
        print(f"{name} ({r['sampler']}) ours/plain median {r['ratio_median']:.3f} (95 % interval {lo:.3f}..{hi:.3f}; "
              f"min {r['ratio_min']:.3f}, max {r['ratio_max']:.3f}); ours {statistics.median(r['ours_s']):.3f} s, "
              f"plain {statistics.median(r['plain_s']):.3f} s for {r['batch']} images x {r['steps']} steps; "
              f"process CPU time ratio median {r['cpu_ratio_median']:.3f} "
              f"({r['cpu_ratio_min']:.3f}..{r['cpu_ratio_max']:.3f})")


if __name__ == "__main__":
    main()
