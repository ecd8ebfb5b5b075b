"""A short GPU check of a text-to-image or diffusion-LM preset: a few RL steps in one process, then step time,
samples/s, peak GPU memory and the bytes one weight sync moves, written to JSON.

    python benchmarks/gpu_check.py configs/sd35-grpo.yaml --steps 3            # the real model (downloaded first)
    python benchmarks/gpu_check.py configs/sd15-grpo.yaml --steps 3 sampler.num_steps=20
    python benchmarks/gpu_check.py --tiny flux --steps 2                        # tiny random pipeline, no download
    python benchmarks/gpu_check.py configs/llada-gsm8k-bgpo.yaml --steps 2      # LLaDA-8B (downloaded first)
    python benchmarks/gpu_check.py configs/llada-gsm8k-bgpo.yaml --tiny llada   # the preset on a tiny LLaDA

It runs `steadyrl train --local` (the product loop in one process: testbed, sampler, DeepSpeed learner, reward
models, without the Ray/Serve layer): the rollout policy, the learner and the reward models share the one GPU. `--tiny` builds a random SD-, SDXL-, SD3- or FLUX-style pipeline of the real
architecture and a tiny CLIP (as the tests do) so the whole path can be checked on a machine without
downloads, on GPU or CPU; `--tiny llada` runs a dLLM preset's objective, sampler, LoRA and bf16 settings on a
tiny random LLaDA-interface model and the shipped addition task file, with lengths and batches cut down. The
first step includes CUDA warm-up and is reported apart.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "gpu_check.json"


def tiny_overrides(family: str, root: Path) -> list[str]:
    """A tiny random pipeline of `family` and a tiny CLIP reward, built under `root`."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests import tiny_models

    pipe = getattr(tiny_models, f"save_tiny_{family}_pipeline")(root / family)
    clip = tiny_models.save_tiny_clip(root / "clip")
    sampler = ["sampler.kind=flow_sde", "sampler.shift=3.0"] if family in ("sd3", "flux") else ["sampler.kind=ddim"]
    if family == "flux":
        sampler.append("testbed.max_sequence_length=16")
    return ["testbed.name=text_to_image", f"testbed.pretrained={pipe}", "testbed.prompts.train=tiny",
            "testbed.prompts.prompts_per_step=4", "sampler.num_steps=6", "sampler.group_size=8",
            f"testbed.reward.models=[{{kind: clip_score, model: {clip}}}, {{kind: jpeg, upscale: 1}}]",
            "testbed.reward.monitor_only=[jpeg_compressibility]", *sampler]


def tiny_llada_overrides(root: Path) -> list[str]:
    """A tiny random LLaDA-interface model and character tokenizer under `root`, and a dLLM preset cut to its size."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.assets.tiny_llada import write_char_tokenizer, write_tiny_llada

    write_tiny_llada(root / "llada", vocab_size=24, mask_token_id=23)
    write_char_tokenizer(root / "llada")
    return [f"testbed.pretrained={root / 'llada'}", "testbed.lora.target_modules=[qkv, proj]",
            "testbed.file.task_file=arith_addition", "testbed.file.eval_file=null", "testbed.file.system_prompt=null",
            "testbed.eval_problems=8", "testbed.prompts_per_step=2", "sampler.gen_length=8",
            "sampler.block_length=4", "sampler.num_steps=8", "sampler.group_size=4", "learner.micro_batch_size=4",
            "learner.optim_batch_size=8", "learner.inner_epochs=1"]


def samples_per_step(cfg) -> int:
    """Samples one RL step draws: the testbed's prompts of a step (one worker) x samples per prompt."""
    from steadyrl.services.testbeds import build_testbed

    prompts, _ = build_testbed(cfg).train_prompts(0, 1, 1)
    return len(prompts) * cfg.sampler.group_size


def check(config: str | None, overrides: list[str], steps: int) -> dict[str, Any]:
    from benchmarks.compare import one_run
    from steadyrl.services.config import load_config

    gpu = torch.cuda.is_available()
    devices = [] if gpu else ["ray.rollout_gpus=0", "ray.learner_gpus=0", "learner.backend=gloo"]
    cfg = load_config(config, [*overrides, f"run.steps={steps}", *devices])
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="steadyrl-gpu-check-") as tmp:
        out = one_run("gpu_check", config or "configs/digits-grpo.yaml", cfg.run.seed,
                      [*overrides, f"run.steps={steps}", *devices, f"ray.torch_threads={torch.get_num_threads()}"],
                      Path(tmp) / "run", eval_every=10**9)
    wall = time.perf_counter() - t0
    rows = out["rows"]
    steady = rows[1:] or rows
    step_s = sum(r["step_s"] for r in steady) / len(steady)
    samples = samples_per_step(cfg)
    return {
        "config": config, "overrides": overrides, "steps": len(rows),
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "first_step_s": rows[0]["step_s"], "step_s": step_s, "samples_per_s": samples / step_s,
        "peak_gpu_memory_gb": torch.cuda.max_memory_allocated() / 2**30 if gpu else None,
        "sync_bytes": rows[-1]["sync_bytes"], "train_reward": [r["proxy"] for r in rows],
        "dtype": getattr(cfg.testbed, "dtype", "float32"), "objective": cfg.objective.name,
        "recompute_logp_absdiff_max": max(r["logp_absdiff_max"] for r in rows),
        "finite": out["stopped_at"] is None, "wall_s": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="a text-to-image preset (configs/sd15-*.yaml, sd35-*.yaml) or a "
                        "dLLM one (configs/llada-*.yaml)")
    parser.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tiny", choices=["sd", "sdxl", "sd3", "flux", "llada"],
                        help="a tiny random pipeline (no preset), or with a dLLM preset a tiny LLaDA")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.config is not None and "=" in args.config:  # `--tiny sd3 key=value`: no preset, only overrides
        args.overrides, args.config = [args.config, *args.overrides], None
    if args.tiny == "llada" and args.config is None:
        parser.error("--tiny llada runs a dLLM preset on a tiny model: give the preset (configs/llada-*.yaml)")
    if args.tiny != "llada" and (args.config is None) == (args.tiny is None):
        parser.error("give a preset or --tiny sd|sdxl|sd3|flux")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny == "llada":
            overrides = tiny_llada_overrides(Path(tmp))
        else:
            overrides = tiny_overrides(args.tiny, Path(tmp)) if args.tiny else []
        result = check(args.config, [*overrides, *args.overrides], args.steps)
    result["tiny"] = args.tiny
    args.out.parent.mkdir(parents=True, exist_ok=True)
    previous = json.loads(args.out.read_text()) if args.out.exists() else []
    args.out.write_text(json.dumps(previous + [result], indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
