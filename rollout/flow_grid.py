"""MixGRPO's flow grid, its model timesteps, and the compressed grid MixGRPO-Flash solves after the SDE window.

From Tencent-Hunyuan/MixGRPO (fastvideo/utils/sampling_utils.py, fastvideo/train_grpo_flux.py):

    sd3_time_shift(shift, t) = shift t / (1 + (shift - 1) t)
    grid       sigma_k = sd3_time_shift(shift, t_k),  t_k = 1 - k / N,  k = 0..N   (N + 1 points, 1 down to 0; shift 3)
    timestep   the model is called at int(sigma * 1000) (the floor), the step formulas use sigma itself
    post grid  after the window's last SDE step `last` (the tail starts at point s = last + 1):
               M = int(max((N - last) * ratio, 1)) points, sigma = sd3_time_shift(shift, linspace(t_s, 0, M)),
               M - 1 steps from sigma_s down to 0 (ratio: --dpm_post_compress_ratio, Flash 0.4, Flash* 0.2)

This is not diffusers' grid: FlowMatchEulerDiscreteScheduler(shift).set_timesteps(N) shifts linspace(1, shift(1/1000),
N) and appends 0 (its last nonzero sigma ~0.009 at shift 3, MixGRPO's 0.111), and FluxPipeline shifts
linspace(1, 1/N, N) by mu(image size) (dynamic shifting).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["sd3_time_shift", "inverse_time_shift", "time_shift_sigmas", "integer_timesteps", "post_window_points",
           "post_window_sigmas", "static_shift"]


def sd3_time_shift(shift: float, t: Tensor) -> Tensor:
    """sigma = shift t / (1 + (shift - 1) t): more of the grid at high noise for shift > 1."""
    return (shift * t) / (1 + (shift - 1) * t)


def inverse_time_shift(shift: float, sigma: Tensor) -> Tensor:
    """t with sd3_time_shift(shift, t) = sigma: t = sigma / (shift - (shift - 1) sigma)."""
    return sigma / (shift - (shift - 1) * sigma)


def time_shift_sigmas(num_steps: int, shift: float) -> Tensor:
    """MixGRPO's grid [N + 1] (float64): sd3_time_shift(shift, linspace(1, 0, N + 1)), from 1 down to 0."""
    return sd3_time_shift(shift, torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64))


def integer_timesteps(sigmas: Tensor, num_train_timesteps: int = 1000) -> Tensor:
    """MixGRPO's model timesteps (float32): int(sigma * 1000), the floor of sigma * 1000 taken in float32 as theirs
    (their sigmas are a float32 tensor); 1000 is their literal, FLUX's num_train_timesteps."""
    return torch.floor(sigmas.float() * float(num_train_timesteps))  # timestep = int(sigma * 1000), sigma >= 0


def post_window_points(num_steps: int, last: int, ratio: float) -> int:
    """Their number of post-window grid points (M - 1 steps): int(max((N - last) * ratio, 1)), evaluated as they do
    (Python int * float), with N grid steps and `last` the index of the window's last SDE step."""
    return int(max((num_steps - last) * ratio, 1))  # num_post_steps


def post_window_sigmas(sigmas: Tensor, first_step: int, shift: float, ratio: float) -> Tensor:
    """The compressed grid [M] (float64) from sigmas[first_step] (the point after the window's last SDE step) to 0:
    sd3_time_shift(shift, linspace(t_s, 0, M)), t_s = inverse_time_shift(shift, sigmas[first_step]) (on their grid,
    the unshifted t_{first_step}), M = `post_window_points`, and at least 2.

    Their M can be 1 (a window ending within 1 / ratio steps of the grid's end, unreached in their 300-step runs):
    their grid then stops at sigma_s > 0 and the image is decoded from a noisy latent. Here M >= 2: one first-order
    step to 0, the x0 prediction."""
    n_steps, last = len(sigmas) - 1, first_step - 1
    if not 1 <= first_step < n_steps:
        raise ValueError(f"a post-window grid starts inside the grid (1 <= first_step < {n_steps}), got {first_step}")
    points = max(post_window_points(n_steps, last, ratio), 2)
    t_s = inverse_time_shift(shift, sigmas[first_step].double())
    post = sd3_time_shift(shift, torch.linspace(float(t_s), 0.0, points, dtype=torch.float64))
    post[0] = sigmas[first_step]  # the window's end point itself (equal up to rounding; theirs bit for bit)
    return post


def static_shift(grid: str, shift: float, model_scheduler: dict | None) -> float | None:
    """The static shift a sampler's grid was built with, to extend it (the post-window grid): `shift` for MixGRPO's
    grid and for diffusers' scheduler grid without a model scheduler (sigma_k = shift(u_k)), the model scheduler's
    `shift` without dynamic shifting; None for a dynamically shifted (FLUX) grid, whose shift depends on mu."""
    if grid == "sd3_time_shift" or model_scheduler is None:
        return shift
    if model_scheduler.get("use_dynamic_shifting", False):
        return None
    return float(model_scheduler.get("shift", 1.0))
