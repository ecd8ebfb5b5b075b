"""Pre-training the arith_bd testbed's block-diffusion LM (a tiny DiffusionGemma) on synthetic problems, cached by
config.

Uniform-noise block-diffusion SFT: each block b of the reference completion (canvas_length tokens) is denoised
against the clean prompt and earlier blocks; each of its tokens is replaced by a uniform random id independently
with probability t ~ U(t_min, 1) (at least one per block), and the model predicts every token of the block, since
it cannot tell which ones are noise:

    loss = E_{(x, y), b, t, z} [ (1 / CL) * sum_{i in block b} -log p_theta(y_i | canvas_b, s, x, y_<b) ]

Self-conditioning s, as the sampler feeds it from its second step on (the softmax of the previous step's logits
through the model's self-conditioning MLP): half the rows get the model's own no-grad first guess on the same
canvas, the others none (DiffusionGemma's per-row `self_conditioning_mask`). Without it the MLP stays at its random
initialisation and perturbs every denoising step after the first.

Stopped by iteration count on one thread, so the base model is bitwise the same in any process; the budget leaves
headroom for RL (greedy exact match well below 100%).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field

from steadyrl.rollout.arith import TOKENIZER, ArithTask
from steadyrl.rollout.block_diffusion_lm import (IMAGE_TOKENS, BlockDiffusionLMConfig, block_logits,
                                                 build_block_diffusion_lm)
from steadyrl.rollout.cache import build_dir_atomically, build_key, cache_root, reproducible_build
from steadyrl.rollout.settings_base import StrictModel
from steadyrl.rollout.state_dict import save_weights
from steadyrl.services.testbeds.pretrain_loop import fit_on_problems

MODEL_FILE = "block_diffusion_lm.safetensors"


class BlockDiffusionPretrainConfig(StrictModel):
    iterations: int = Field(300, ge=1, description="optimiser steps (few enough that RL has room to improve)")
    batch_size: int = Field(128, ge=1)
    lr: float = Field(2e-3, gt=0)
    t_min: float = Field(0.1, gt=0, lt=1, description="corruption rate t ~ U(t_min, 1)")
    seed: int = 0
    problem_seed: int = Field(101, description="seed of the pre-training problems (RL and eval use others)")


def uniform_noise_loss(model, prompt: torch.Tensor, completion: torch.Tensor, canvas_length: int, t_min: float,
                       gen: torch.Generator) -> torch.Tensor:
    """The loss in the module docstring for one batch (one block, drawn uniformly, for every row)."""
    B, L = completion.shape
    vocab = len(TOKENIZER) + IMAGE_TOKENS
    start = torch.randint(L // canvas_length, (1,), generator=gen).item() * canvas_length  # one block per batch
    block = completion[:, start:start + canvas_length]
    t = t_min + (1 - t_min) * torch.rand(B, 1, generator=gen)
    corrupt = torch.rand(B, canvas_length, generator=gen) < t
    corrupt[torch.arange(B), torch.randint(canvas_length, (B,), generator=gen)] = True
    canvas = torch.where(corrupt, torch.randint(vocab, block.shape, generator=gen), block)
    prefix = torch.cat([prompt, completion[:, :start]], dim=1)
    with torch.no_grad():  # self-conditioning: half the rows see the model's own first guess, as its sampler feeds it
        guess = block_logits(model, prefix, None, canvas)
    conditioned = torch.rand(B, generator=gen) < 0.5
    logits = block_logits(model, prefix, None, canvas, guess, conditioned)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), block.reshape(-1))


def pretrain_block_diffusion_lm(task: ArithTask, model_cfg: BlockDiffusionLMConfig, canvas_length: int,
                                cfg: BlockDiffusionPretrainConfig, progress: bool = True):
    """Train a tiny DiffusionGemma on `task`'s problems; returns (model, losses)."""
    with reproducible_build(cfg.seed) as gen:
        model = build_block_diffusion_lm(model_cfg, len(TOKENIZER), TOKENIZER.pad_id, TOKENIZER.eos_id,
                                         canvas_length)
        trained = [p for p in model.parameters() if p.requires_grad]
        losses = fit_on_problems(
            model, task, lambda m, prompt, completion: uniform_noise_loss(m, prompt, completion, canvas_length,
                                                                          cfg.t_min, gen),
            iterations=cfg.iterations, batch_size=cfg.batch_size, lr=cfg.lr, problem_seed=cfg.problem_seed,
            title=f"pretraining block-diffusion LM ({task.task})", progress=progress, params=trained)
        return model.eval(), losses


def ensure_pretrained_block_diffusion_lm(task: ArithTask, model_cfg: BlockDiffusionLMConfig, canvas_length: int,
                                         cfg: BlockDiffusionPretrainConfig, progress: bool = True) -> Path:
    """Path of the cached pre-trained weights; trains and caches them first if missing."""
    spec = {"task": task.__dict__, "model": model_cfg.model_dump(), "canvas_length": canvas_length,
            "pretrain": cfg.model_dump(), "vocab": TOKENIZER.vocab}

    def build(tmp: Path) -> None:
        model, losses = pretrain_block_diffusion_lm(task, model_cfg, canvas_length, cfg, progress)
        save_weights(model, tmp / MODEL_FILE)
        meta = {**spec, "final_loss": sum(losses[-20:]) / len(losses[-20:])}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))

    target = cache_root() / "models" / f"arith-{task.task}-bdlm-{build_key(spec)}"
    return build_dir_atomically(target, build) / MODEL_FILE
