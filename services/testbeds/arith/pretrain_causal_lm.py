"""Pre-training the arith_ar testbed's causal LM on synthetic problems, cached by config.

Supervised next-token training on the reference completion, up to and including its first EOS:

    loss = E_{(x, y)} [ (1 / |V|) * sum_{t in V} -log p_theta(y_t | x, y_<t) ]

Stopped by iteration count (not wall time) on one thread, so the base model is bitwise the same in any process;
the budget leaves headroom for RL (greedy exact match well below 100%).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field

from steadyrl.rollout.arith import TOKENIZER, ArithTask
from steadyrl.rollout.cache import build_dir_atomically, build_key, cache_root, reproducible_build
from steadyrl.rollout.causal_lm import CausalLMConfig, build_causal_lm
from steadyrl.rollout.likelihood import completion_valid
from steadyrl.rollout.settings_base import StrictModel
from steadyrl.rollout.state_dict import save_weights
from steadyrl.services.testbeds.pretrain_loop import fit_on_problems

MODEL_FILE = "causal_lm.safetensors"


class CausalLMPretrainConfig(StrictModel):
    iterations: int = Field(300, ge=1, description="optimiser steps (few enough that RL has room to improve)")
    batch_size: int = Field(256, ge=1)
    lr: float = Field(1e-3, gt=0)
    seed: int = 0
    problem_seed: int = Field(101, description="seed of the pre-training problems (RL and eval use others)")


def next_token_loss(model, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """The loss in the module docstring for one batch of unpadded prompts [B, P] and completions [B, L]."""
    P = prompt.shape[1]
    logits = model(torch.cat([prompt, completion], dim=1)).logits[:, P - 1:-1]
    valid = completion_valid(completion, TOKENIZER.eos_id)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), completion.reshape(-1), reduction="none")
    return ((nll.view_as(completion) * valid).sum(1) / valid.sum(1)).mean()


def pretrain_causal_lm(task: ArithTask, model_cfg: CausalLMConfig, cfg: CausalLMPretrainConfig,
                       progress: bool = True):
    """Train a tiny causal LM on `task`'s problems; returns (model, losses)."""
    with reproducible_build(cfg.seed):
        model = build_causal_lm(model_cfg, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id)
        losses = fit_on_problems(model, task, next_token_loss, iterations=cfg.iterations, batch_size=cfg.batch_size,
                                 lr=cfg.lr, problem_seed=cfg.problem_seed, title=f"pretraining causal LM ({task.task})",
                                 progress=progress)
        return model.eval(), losses


def ensure_pretrained_causal_lm(task: ArithTask, model_cfg: CausalLMConfig, cfg: CausalLMPretrainConfig,
                                progress: bool = True) -> Path:
    """Path of the cached pre-trained weights; trains and caches them first if missing."""
    spec = {"task": task.__dict__, "model": model_cfg.model_dump(), "pretrain": cfg.model_dump(),
            "vocab": TOKENIZER.vocab}

    def build(tmp: Path) -> None:
        model, losses = pretrain_causal_lm(task, model_cfg, cfg, progress)
        save_weights(model, tmp / MODEL_FILE)
        meta = {**spec, "final_loss": sum(losses[-20:]) / len(losses[-20:])}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))

    target = cache_root() / "models" / f"arith-{task.task}-clm-{build_key(spec)}"
    return build_dir_atomically(target, build) / MODEL_FILE
