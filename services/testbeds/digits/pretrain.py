"""Pre-training the testbed diffusion models, cached by config.

Two kinds share the UNet architecture: `prediction="epsilon"` (DDPM epsilon loss, sampled with DDIM)
and `prediction="velocity"` (rectified flow / flow matching, sampled with the flow SDE).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor
from pydantic import Field
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from steadyrl.rollout.cache import build_dir_atomically, build_key, cache_root, reproducible_build
from steadyrl.rollout.config import SchedulerConfig, UNetConfig
from steadyrl.rollout.digits import digit_splits, load_digits_tensors
from steadyrl.rollout.settings_base import StrictModel
from steadyrl.rollout.state_dict import save_weights

MODEL_FILE = "unet.safetensors"

Prediction = Literal["epsilon", "velocity"]


class PretrainConfig(StrictModel):
    """Stopped by iteration count (not wall time) so machine load never changes the base model."""

    iterations: int = Field(80, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(5e-4, gt=0)
    seed: int = 0


def epsilon_pair(x0: Tensor, alphas: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(x_t, t, eps): x_t = sqrt(a_t) x0 + sqrt(1 - a_t) eps, t uniform on the integer training timesteps."""
    t = torch.randint(len(alphas), (len(x0),), generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    a = alphas[t].view(-1, 1, 1, 1)
    return a.sqrt() * x0 + (1 - a).sqrt() * noise, t, noise


def velocity_pair(x0: Tensor, n_train: int, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """(x_s, s * n_train, eps - x0): x_s = (1 - s) x0 + s eps, s ~ U(0, 1)."""
    s = torch.rand(len(x0), generator=gen)
    noise = torch.randn(x0.shape, generator=gen)
    s4 = s.view(-1, 1, 1, 1)
    return (1 - s4) * x0 + s4 * noise, s * n_train, noise - x0


def pretrain_unet(
    unet_cfg: UNetConfig,
    sched_cfg: SchedulerConfig,
    cfg: PretrainConfig,
    progress: bool = True,
    prediction: Prediction = "epsilon",
):
    """Train a class-conditional UNet on the digits (all but the held-out test split).

    epsilon:  E_{x0, t, eps} || eps - eps_theta(sqrt(a_t) x0 + sqrt(1 - a_t) eps, t, y) ||^2,
              t uniform on the integer training timesteps.
    velocity: E_{x0, s, eps} || (eps - x0) - v_theta((1 - s) x0 + s eps, s * num_train_timesteps, y) ||^2,
              s ~ U(0, 1) (uniform, not SD3's logit-normal: the flow sampler's default grid, shift 1,
              is uniform in s too), the model timestep continuous (diffusers' flow-matching convention).
    """
    from steadyrl.rollout.models import build_scheduler, build_unet  # diffusers: only once a base is built

    if prediction not in ("epsilon", "velocity"):
        raise ValueError(f"prediction={prediction!r} must be 'epsilon' or 'velocity'")
    with reproducible_build(cfg.seed) as gen:
        images, labels = load_digits_tensors()
        splits = digit_splits()
        keep = torch.as_tensor(list(splits.gold) + list(splits.proxy))
        images, labels = images[keep], labels[keep]
        model = build_unet(unet_cfg)
        sched = build_scheduler(sched_cfg)
        alphas = sched.alphas_cumprod.float()
        n_train = sched_cfg.num_train_timesteps
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        losses = []
        kind = "diffusion" if prediction == "epsilon" else "rectified-flow"
        with Progress(
            TextColumn(f"[bold]pretraining {kind} model"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
            TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), disable=not progress,
        ) as bar:
            task = bar.add_task("pretrain", total=cfg.iterations, loss=float("nan"))
            for _ in range(cfg.iterations):
                idx = torch.randint(len(images), (cfg.batch_size,), generator=gen)
                x0, y = images[idx], labels[idx]
                xt, t, target = (epsilon_pair(x0, alphas, gen) if prediction == "epsilon"
                                 else velocity_pair(x0, n_train, gen))
                loss = F.mse_loss(model(xt, t, class_labels=y).sample, target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                losses.append(loss.item())
                bar.update(task, advance=1, loss=sum(losses[-10:]) / len(losses[-10:]))
        return model.eval(), losses


def pretrained_unet_dir(
    unet_cfg: UNetConfig, sched_cfg: SchedulerConfig, cfg: PretrainConfig, prediction: Prediction = "epsilon"
) -> Path:
    """Cache folder of a pre-trained model: `digits-unet-<key>` (epsilon) or `digits-flow-unet-<key>` (velocity,
    the prediction in the key), keyed by the configs and the build recipe (`rollout.cache.build_key`)."""
    spec = {"unet": unet_cfg.model_dump(), "sched": sched_cfg.model_dump(), "pretrain": cfg.model_dump()}
    if prediction == "epsilon":
        return cache_root() / "models" / f"digits-unet-{build_key(spec)}"
    if prediction == "velocity":
        return cache_root() / "models" / f"digits-flow-unet-{build_key({**spec, 'prediction': prediction})}"
    raise ValueError(f"prediction={prediction!r} must be 'epsilon' or 'velocity'")


def ensure_pretrained_unet(
    unet_cfg: UNetConfig,
    sched_cfg: SchedulerConfig,
    cfg: PretrainConfig,
    progress: bool = True,
    prediction: Prediction = "epsilon",
) -> Path:
    """Path of the cached pre-trained weights; trains and caches them first if missing."""
    target = pretrained_unet_dir(unet_cfg, sched_cfg, cfg, prediction)

    def build(tmp: Path) -> None:
        model, losses = pretrain_unet(unet_cfg, sched_cfg, cfg, progress, prediction=prediction)
        save_weights(model, tmp / MODEL_FILE)
        meta = {"unet": unet_cfg.model_dump(), "scheduler": sched_cfg.model_dump(), "pretrain": cfg.model_dump(),
                "prediction": prediction, "final_loss": sum(losses[-10:]) / len(losses[-10:])}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))

    return build_dir_atomically(target, build) / MODEL_FILE
