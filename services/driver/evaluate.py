"""`steadyrl eval RUN_DIR`: score a checkpoint's seeded samples in-process (no Ray needed)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from steadyrl.services.config import load_config
from steadyrl.services.driver.controller import CHECKPOINTS, latest_checkpoint
from steadyrl.services.testbeds import build_testbed


def evaluate_checkpoint(run_dir: Path, step: int | None = None, n_per_prompt: int | None = None,
                        seed: int | None = None) -> dict[str, Any]:
    """The testbed's held-out evaluation of one checkpoint (accuracy with its breakdown, training reward,
    diversity), scored by the same reward models in-process. Writes RUN_DIR/eval_step_N/{eval.json,samples.*}."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    testbed = build_testbed(cfg)
    ckpt = latest_checkpoint(run_dir) if step is None else run_dir / CHECKPOINTS / f"step_{step}"
    if ckpt is None or not ckpt.exists():
        raise FileNotFoundError(f"no checkpoint {'latest' if step is None else f'step_{step}'} in {run_dir}")
    policy = testbed.build_policy(load_file(str(ckpt / "policy.safetensors")))
    gen = torch.Generator().manual_seed(cfg.run.eval_seed if seed is None else seed)
    batch = testbed.sample(testbed.eval_sampler(), policy, testbed.eval_prompts(),
                           n_per_prompt or testbed.eval_per_prompt, gen)
    scores = testbed.reward_ensemble().score_all(*testbed.reward_inputs(policy, batch), batch.group)
    result = {"checkpoint": str(ckpt), **testbed.eval_summary(batch, scores)}
    out = run_dir / f"eval_{ckpt.name}"
    out.mkdir(exist_ok=True)
    testbed.save_eval(result, out / "samples", f"{ckpt.name}: {testbed.headline_text(result['held_out'])}")
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result
