"""DDIM (eta > 0) as a Gaussian policy per inference step, with exact log-probabilities.

For inference step k with model timestep t and previous timestep t_prev (DDPO):
    x0_hat = (x_t - sqrt(1 - a_t) * eps) / sqrt(a_t)
    sigma  = eta * sqrt((1 - a_prev) / (1 - a_t)) * sqrt(1 - a_t / a_prev)
    mu     = sqrt(a_prev) * x0_hat + sqrt(1 - a_prev - sigma^2) * eps
    x_prev ~ N(mu, sigma^2 I)
where a = alphas_cumprod.  Steps with sigma < min_std (with diffusers' defaults, the last one)
are deterministic: they carry no log-prob and are never trained.
"""
from __future__ import annotations

import math
from typing import Protocol

import torch
from diffusers import DDIMScheduler
from torch import Tensor

from rollout.batch import RolloutBatch
from rollout.config import SamplerConfig


class EpsModel(Protocol):
    """Anything called like a diffusers UNet: model(x, t, class_labels=c).sample -> eps."""

    def __call__(self, sample: Tensor, timestep: Tensor, class_labels: Tensor | None = ...) -> object: ...


def gaussian_logp(x: Tensor, mean: Tensor, std: Tensor, reduce: str) -> Tensor:
    """log N(x; mean, std^2 I) per sample, reduced over non-batch dims by `mean` or `sum`.

    `std` has shape [B] (one std per sample and step).
    """
    std = std.view(-1, *([1] * (x.dim() - 1)))
    lp = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - 0.5 * math.log(2 * math.pi)
    dims = tuple(range(1, x.dim()))
    return lp.mean(dim=dims) if reduce == "mean" else lp.sum(dim=dims)


class DDIMLogProbSampler:
    """Samples groups per class and recomputes the same per-step log-probs for training."""

    def __init__(self, cfg: SamplerConfig, scheduler: DDIMScheduler):
        self.cfg = cfg
        sched = DDIMScheduler.from_config(scheduler.config)
        sched.set_timesteps(cfg.num_steps)
        self.timesteps = sched.timesteps.clone().long()  # [T], descending
        stride = sched.config.num_train_timesteps // cfg.num_steps
        alphas = sched.alphas_cumprod.double()
        prev = self.timesteps - stride
        final = torch.tensor(float(sched.final_alpha_cumprod), dtype=torch.float64)
        self.alpha_t = alphas[self.timesteps]
        self.alpha_prev = torch.where(prev >= 0, alphas[prev.clamp(min=0)], final)
        var = (1 - self.alpha_prev) / (1 - self.alpha_t) * (1 - self.alpha_t / self.alpha_prev)
        self.std = cfg.eta * var.clamp(min=0).sqrt()  # [T], float64
        self.trainable = self.std >= cfg.min_std  # [T]

    @property
    def trainable_steps(self) -> Tensor:
        """Indices of the stochastic (trainable) inference steps."""
        return torch.nonzero(self.trainable).flatten()

    def step_mean(self, model: EpsModel, x_t: Tensor, step: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and std of pi(x_prev | x_t) at inference step indices `step` [B]."""
        dt = x_t.dtype
        shape = (-1,) + (1,) * (x_t.dim() - 1)
        a_t = self.alpha_t[step].to(dt).view(shape)
        a_prev = self.alpha_prev[step].to(dt).view(shape)
        std = self.std[step].to(dt)
        eps = model(x_t, self.timesteps[step], class_labels=cond).sample
        x0 = (x_t - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        dir_coef = (1 - a_prev - std.view(shape) ** 2).clamp(min=0).sqrt()
        mean = a_prev.sqrt() * x0 + dir_coef * eps
        return mean, std

    @torch.no_grad()
    def sample(
        self,
        model: EpsModel,
        cond: Tensor,
        n_per_cond: int,
        generator: torch.Generator,
        dtype: torch.dtype = torch.float32,
        sample_shape: tuple[int, ...] = (1, 8, 8),
        group_offset: int = 0,
    ) -> RolloutBatch:
        """Draw `n_per_cond` samples for each entry of `cond`; one group per entry, numbered from
        `group_offset` (workers use distinct offsets so their batches can be joined)."""
        n_groups = len(cond)
        cond = cond.long().repeat_interleave(n_per_cond)
        group = (group_offset + torch.arange(n_groups)).repeat_interleave(n_per_cond)
        B, T = len(cond), self.cfg.num_steps
        x = torch.randn((B, *sample_shape), generator=generator, dtype=dtype)
        traj = [x]
        logps = []
        for k in range(T):
            step = torch.full((B,), k, dtype=torch.long)
            mean, std = self.step_mean(model, x, step, cond)
            if self.trainable[k]:
                noise = torch.randn(x.shape, generator=generator, dtype=dtype)
                x = mean + std.view(-1, 1, 1, 1) * noise
                logps.append(gaussian_logp(x, mean, std, self.cfg.logp_reduce))
            else:
                x = mean
                logps.append(torch.zeros(B, dtype=dtype))
            traj.append(x)
        return RolloutBatch(
            cond=cond,
            group=group,
            samples=x,
            traj=torch.stack(traj, dim=1),
            old_logp=torch.stack(logps, dim=1),
            timesteps=self.timesteps.clone(),
            trainable=self.trainable.clone(),
        )

    def log_prob(
        self, model: EpsModel, batch: RolloutBatch, step: Tensor | int, return_mean: bool = False
    ) -> Tensor | tuple[Tensor, Tensor, Tensor]:
        """Recompute log pi(x_prev | x_t) [B] at inference step(s) `step` (int or [B]); same math as `sample`.

        With `return_mean`, also returns the step's mean [B,...] and std [B] (for analytic KLs).
        """
        B = len(batch)
        if isinstance(step, int):
            step = torch.full((B,), step, dtype=torch.long)
        if not bool(self.trainable[step].all()):
            raise ValueError("log_prob asked for a deterministic (untrainable) step")
        rows = torch.arange(B)
        x_t = batch.traj[rows, step]
        x_prev = batch.traj[rows, step + 1]
        mean, std = self.step_mean(model, x_t, step, batch.cond)
        logp = gaussian_logp(x_prev, mean, std, self.cfg.logp_reduce)
        return (logp, mean, std) if return_mean else logp
