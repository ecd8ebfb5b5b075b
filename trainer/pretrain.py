"""Pre-training the testbed diffusion model (DDPM epsilon loss), cached by config."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from rollout.cache import build_dir_atomically, cache_root, config_key
from rollout.config import SchedulerConfig, StrictModel, UNetConfig
from rollout.digits import digit_splits, load_digits_tensors
from rollout.models import build_scheduler, build_unet, save_weights

MODEL_FILE = "unet.safetensors"


class PretrainConfig(StrictModel):
    """Stopped by iteration count (not wall time) so machine load never changes the base model."""

    iterations: int = Field(80, ge=1)
    batch_size: int = Field(128, ge=1)
    lr: float = Field(5e-4, gt=0)
    seed: int = 0


def pretrain_unet(unet_cfg: UNetConfig, sched_cfg: SchedulerConfig, cfg: PretrainConfig, progress: bool = True):
    """Train a class-conditional UNet on the digits (all but the held-out test split).

    Loss: E_{x0, t, eps} || eps - eps_theta(sqrt(a_t) x0 + sqrt(1 - a_t) eps, t, y) ||^2.
    """
    torch.manual_seed(cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    images, labels = load_digits_tensors()
    splits = digit_splits()
    keep = torch.as_tensor(list(splits.gold) + list(splits.proxy))
    images, labels = images[keep], labels[keep]
    model = build_unet(unet_cfg)
    sched = build_scheduler(sched_cfg)
    alphas = sched.alphas_cumprod.float()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses = []
    with Progress(
        TextColumn("[bold]pretraining diffusion model"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.4f}"), TimeElapsedColumn(), disable=not progress,
    ) as bar:
        task = bar.add_task("pretrain", total=cfg.iterations, loss=float("nan"))
        for _ in range(cfg.iterations):
            idx = torch.randint(len(images), (cfg.batch_size,), generator=gen)
            x0, y = images[idx], labels[idx]
            t = torch.randint(sched_cfg.num_train_timesteps, (cfg.batch_size,), generator=gen)
            noise = torch.randn(x0.shape, generator=gen)
            a = alphas[t].view(-1, 1, 1, 1)
            xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
            loss = F.mse_loss(model(xt, t, class_labels=y).sample, noise)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            bar.update(task, advance=1, loss=sum(losses[-10:]) / len(losses[-10:]))
    return model.eval(), losses


def pretrained_unet_dir(unet_cfg: UNetConfig, sched_cfg: SchedulerConfig, cfg: PretrainConfig) -> Path:
    key = config_key({"unet": unet_cfg.model_dump(), "sched": sched_cfg.model_dump(), "pretrain": cfg.model_dump()})
    return cache_root() / "models" / f"digits-unet-{key}"


def ensure_pretrained_unet(
    unet_cfg: UNetConfig, sched_cfg: SchedulerConfig, cfg: PretrainConfig, progress: bool = True
) -> Path:
    """Path of the cached pre-trained weights; trains and caches them first if missing."""
    target = pretrained_unet_dir(unet_cfg, sched_cfg, cfg)

    def build(tmp: Path) -> None:
        model, losses = pretrain_unet(unet_cfg, sched_cfg, cfg, progress)
        save_weights(model, tmp / MODEL_FILE)
        meta = {"unet": unet_cfg.model_dump(), "scheduler": sched_cfg.model_dump(), "pretrain": cfg.model_dump(),
                "final_loss": sum(losses[-10:]) / len(losses[-10:])}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2))

    return build_dir_atomically(target, build) / MODEL_FILE

