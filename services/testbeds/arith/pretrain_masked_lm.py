"""Pre-training the arith testbed's masked-diffusion LM on synthetic problems, cached by config.

Masked-diffusion SFT (LLaDA): the prompt stays clean, each completion token is masked independently
with probability t ~ U(t_min, 1), and

    loss = E_{(x, y), t, M} [ (1 / t) * (1 / L) * sum_{i in M} -log p_theta(y_i | x, y_{~M}) ]

Stopped by iteration count, not wall time, so machine load never changes the base model; the budget is
chosen to leave headroom for RL (greedy exact match well below 100%, so learning shows).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field

from steadyrl.rollout.arith import TOKENIZER, ArithTask
from steadyrl.rollout.cache import build_dir_atomically, build_key, cache_root, reproducible_build
from steadyrl.rollout.masked_lm import MaskedLMConfig, build_masked_lm
from steadyrl.rollout.settings_base import StrictModel
from steadyrl.rollout.state_dict import save_weights
from steadyrl.services.testbeds.pretrain_loop import fit_on_problems

MODEL_FILE = "masked_lm.safetensors"


class MaskedLMPretrainConfig(StrictModel):
    iterations: int = Field(400, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(1e-3, gt=0)
    t_min: float = Field(0.05, gt=0, lt=1, description="mask rate t ~ U(t_min, 1); the 1/t weight stays bounded")
    seed: int = 0
    problem_seed: int = Field(101, description="seed of the pre-training problems (RL and eval use others)")


def masked_diffusion_loss(model, prompt: torch.Tensor, completion: torch.Tensor, t_min: float,
                          gen: torch.Generator) -> torch.Tensor:
    """The loss in the module docstring for one batch (at least one token masked per row)."""
    B, L = completion.shape
    t = t_min + (1 - t_min) * torch.rand(B, 1, generator=gen)
    mask = torch.rand(B, L, generator=gen) < t
    mask[torch.arange(B), torch.randint(L, (B,), generator=gen)] = True
    noisy = completion.masked_fill(mask, TOKENIZER.mask_token_id)
    logits = model(torch.cat([prompt, noisy], dim=1)).logits[:, prompt.shape[1]:]
    nll = F.cross_entropy(logits.reshape(B * L, -1), completion.reshape(-1), reduction="none").view(B, L)
    return ((nll * mask).sum(1) / (t.squeeze(1) * L)).mean()


def pretrain_masked_lm(task: ArithTask, model_cfg: MaskedLMConfig, cfg: MaskedLMPretrainConfig,
                       progress: bool = True):
    """Train a tiny masked LM on `task`'s problems; returns (model, losses)."""
    with reproducible_build(cfg.seed) as gen:
        model = build_masked_lm(model_cfg, len(TOKENIZER), TOKENIZER.pad_id)
        losses = fit_on_problems(
            model, task, lambda m, prompt, completion: masked_diffusion_loss(m, prompt, completion, cfg.t_min, gen),
            iterations=cfg.iterations, batch_size=cfg.batch_size, lr=cfg.lr, problem_seed=cfg.problem_seed,
            title=f"pretraining masked-diffusion LM ({task.task})", progress=progress)
        return model.eval(), losses


def pretrained_masked_lm_dir(task: ArithTask, model_cfg: MaskedLMConfig, cfg: MaskedLMPretrainConfig) -> Path:
    spec = {"task": task.__dict__, "model": model_cfg.model_dump(), "pretrain": cfg.model_dump(),
            "vocab": TOKENIZER.vocab}
    return cache_root() / "models" / f"arith-{task.task}-mlm-{build_key(spec)}"


def ensure_pretrained_masked_lm(task: ArithTask, model_cfg: MaskedLMConfig, cfg: MaskedLMPretrainConfig,
                                progress: bool = True) -> Path:
    """Path of the cached pre-trained weights; trains and caches them first if missing."""

    def build(tmp: Path) -> None:
        model, losses = pretrain_masked_lm(task, model_cfg, cfg, progress)
        save_weights(model, tmp / MODEL_FILE)
        meta = {"task": task.__dict__, "model": model_cfg.model_dump(), "pretrain": cfg.model_dump(),
                "final_loss": sum(losses[-20:]) / len(losses[-20:])}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))

    return build_dir_atomically(pretrained_masked_lm_dir(task, model_cfg, cfg), build) / MODEL_FILE
