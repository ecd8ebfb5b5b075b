"""The two rollout backends of the autoregressive sampler side by side: transformers (a KV-cached loop in the
worker's process) and vLLM (an engine in the worker), same model, same batch, same sampling settings; and the
learner -> engine sync time, full weights vs LoRA adapters. Run in the vLLM venv:

    make vllm-venv && .venv-vllm/bin/python benchmarks/rollout_backends.py   # -> results/rollout_backends.json

Each figure is the median of `--repeats` timed runs after one warm-up, measured in this one process in
alternation (transformers, vLLM, transformers, ...), so machine load hits both alike; the spread is (min, max).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from steadyrl.rollout.arith import TOKENIZER, ArithTask  # noqa: E402
from steadyrl.rollout.autoregressive import AutoregressiveSampler  # noqa: E402
from steadyrl.rollout.causal_lm import CausalLMConfig, build_causal_lm, write_hf_checkpoint  # noqa: E402
from steadyrl.rollout.config import AutoregressiveSamplerConfig, VLLMEngineConfig  # noqa: E402
from steadyrl.rollout.lora import LoRAConfig, add_lora  # noqa: E402
from steadyrl.rollout.policy import LanguageModelPolicy, state_bytes, trainable_state  # noqa: E402
from steadyrl.rollout.vllm_engine import VLLMEngine  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "rollout_backends.json"


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--gen-length", type=int, default=32, help="most tokens per completion (a random model's EOS ends "
                    "them earlier, alike in both backends: tokens/s counts the tokens generated)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = CausalLMConfig(max_positions=16 + args.gen_length)
    torch.manual_seed(0)
    policy = LanguageModelPolicy(build_causal_lm(cfg, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id)).eval()
    task = ArithTask()
    prompts = task.encode_prompts(task.problems(0, range(args.prompts)))
    sampler = AutoregressiveSampler(AutoregressiveSamplerConfig(gen_length=args.gen_length, group_size=args.group_size),
                                    TOKENIZER.eos_id, TOKENIZER.pad_id)
    tmp = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    engine = VLLMEngine(str(write_hf_checkpoint(policy.net, tmp / "full")), VLLMEngineConfig(), cfg.max_positions,
                        trainable_state(policy), ["LlamaForCausalLM"])
    engine_start = time.perf_counter() - t0
    backends = {"transformers": policy, "vllm": engine}
    times: dict[str, list[float]] = {name: [] for name in backends}
    tokens: dict[str, list[int]] = {name: [] for name in backends}
    for rep in range(args.repeats + 1):
        for name, who in backends.items():
            t0 = time.perf_counter()
            batch = sampler.sample(who, prompts, args.group_size, torch.Generator().manual_seed(rep))
            if rep:  # the first round warms up
                times[name].append(time.perf_counter() - t0)
                tokens[name].append(int(sampler.valid(batch.samples).sum()))
    completions = args.prompts * args.group_size
    full = trainable_state(policy)
    full_sync = [timed(lambda: engine.load_trainable_state_dict(full)) for _ in range(args.repeats)]

    lora_cfg = LoRAConfig(rank=8, alpha=16.0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    lora_policy = add_lora(LanguageModelPolicy(build_causal_lm(cfg, len(TOKENIZER), TOKENIZER.pad_id,
                                                               TOKENIZER.eos_id)), lora_cfg, targets)
    adapters = trainable_state(lora_policy)
    lora_engine = VLLMEngine(str(write_hf_checkpoint(lora_policy.net, tmp / "lora")), VLLMEngineConfig(),
                             cfg.max_positions, adapters, ["LlamaForCausalLM"], lora_cfg, targets)
    lora_sync = [timed(lambda: lora_engine.load_trainable_state_dict(adapters)) for _ in range(args.repeats)]

    import vllm
    result = {
        "setting": {**vars(args), "model": cfg.model_dump(), "parameters": sum(p.numel() for p in policy.parameters()),
                    "dtype": "float32", "device": "cpu", "vllm": vllm.__version__, "torch": torch.__version__},
        "completions_per_batch": completions,
        "seconds_per_batch": {name: summary(t) for name, t in times.items()},
        "completions_per_s": {name: completions / statistics.median(t) for name, t in times.items()},
        "tokens_per_s": {name: sum(tokens[name]) / sum(t) for name, t in times.items()},
        "vllm_over_transformers_throughput": statistics.median(times["transformers"]) / statistics.median(times["vllm"]),
        "engine_start_s": engine_start,
        "sync_s": {"full": summary(full_sync), "lora": summary(lora_sync)},
        "sync_bytes": {"full": state_bytes(full), "lora": state_bytes(adapters)},
    }
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("completions_per_s", "tokens_per_s", "vllm_over_transformers_throughput",
                                             "sync_s", "engine_start_s")},
                     indent=1))


if __name__ == "__main__":
    main()
