"""`steadyrl eval RUN_DIR`: score a checkpoint's seeded samples in-process (no Ray needed). Its checkpoint policy
and seeded draw are also `Run.load_policy` and `Run.sample` (services/driver/api.py)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.services.config import load_config
from steadyrl.services.driver.controller import CHECKPOINTS, latest_checkpoint
from steadyrl.services.testbeds import build_testbed
from steadyrl.services.testbeds.base import Testbed


def checkpoint_dir(run_dir: Path, step: int | None = None) -> Path:
    """checkpoints/step_N of the run (default: the latest); FileNotFoundError naming it when there is none."""
    ckpt = latest_checkpoint(run_dir) if step is None else Path(run_dir) / CHECKPOINTS / f"step_{step}"
    if ckpt is None or not ckpt.exists():
        raise FileNotFoundError(f"no checkpoint {'latest' if step is None else f'step_{step}'} in {run_dir}")
    return ckpt


def checkpoint_policy(testbed: Testbed, ckpt: Path) -> nn.Module:
    """The policy as the testbed builds it, holding the checkpoint's trained tensors (policy.safetensors)."""
    return testbed.build_policy(load_file(str(Path(ckpt) / "policy.safetensors")))


def seeded_samples(testbed: Testbed, policy: nn.Module, prompts: Tensor, n_per_prompt: int, seed: int) -> RolloutBatch:
    """`n_per_prompt` samples of each prompt from the testbed's evaluation sampler, drawn from generator `seed`."""
    return testbed.sample(testbed.eval_sampler(), policy, prompts, n_per_prompt, torch.Generator().manual_seed(seed))


def evaluate_checkpoint(run_dir: Path, step: int | None = None, n_per_prompt: int | None = None,
                        seed: int | None = None) -> dict[str, Any]:
    """The testbed's held-out evaluation of one checkpoint (accuracy with its breakdown, training reward,
    diversity), scored by the same reward models in-process. Writes RUN_DIR/eval_step_N/{eval.json,samples.*}."""
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml")
    testbed = build_testbed(cfg)
    ckpt = checkpoint_dir(run_dir, step)
    policy = checkpoint_policy(testbed, ckpt)
    batch = seeded_samples(testbed, policy, testbed.eval_prompts(), n_per_prompt or testbed.eval_per_prompt,
                           cfg.run.eval_seed if seed is None else seed)
    scores = testbed.reward_ensemble().score_all(*testbed.reward_inputs(policy, batch), batch.group)
    result = {"checkpoint": str(ckpt), **testbed.eval_summary(batch, scores)}
    out = run_dir / f"eval_{ckpt.name}"
    out.mkdir(exist_ok=True)
    testbed.save_eval(result, out / "samples", f"{ckpt.name}: {testbed.headline_text(result['held_out'])}")
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    return result
