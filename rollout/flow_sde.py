"""Flow-GRPO's SDE on a rectified-flow (velocity-prediction) model, as a Gaussian policy per step.

Rectified flow: x_s = (1 - s) x0 + s eps, s = 1 is pure noise, and the model predicts the velocity
v = eps - x0 (so x0 = x - s v and eps = x + (1 - s) v).  The probability-flow ODE dx = v ds is
replaced by the SDE with the same marginals (Flow-GRPO, Liu et al. 2025, eq. 9); one Euler-Maruyama
step from grid value s to s_next (Delta = s_next - s < 0) is

    sigma_s = a * sqrt(s / (1 - s'))        s' = s, except at s == 1 where s' = s_next
    mean    = x + [v + sigma_s^2 / (2 s) * (x + (1 - s) v)] * Delta
    std     = sigma_s * sqrt(|Delta|)
    x_next ~ N(mean, std^2 I)

with a = `cfg.noise_level` (~0.7).  At s = 1, sqrt(s / (1 - s)) is infinite, so the first step uses
the next grid value in the denominator, as yifan123/flow_grpo's `sde_step_with_logprob` does
(`sigma_max = sigmas[1]`).  The grid s_0 = 1 > s_1 > ... > s_T = 0 is diffusers'
`FlowMatchEulerDiscreteScheduler` (with `cfg.shift`) after `set_timesteps(num_steps)`; the model is
called at timestep s * num_train_timesteps (diffusers' `scheduler.timesteps`).  Steps whose std is
below `cfg.min_std` (with the default grid, the last one, s = 1/num_train_timesteps -> 0) take the
mean without noise, carry no log-prob and are never trained.

With `cfg.sde_window` (MixGRPO, Flow-GRPO-Fast) a training rollout draws only the window's steps from the SDE
(rollout/sde_window.py picks them from the training step); its other stochastic steps take the ODE (Euler) step
x_next = x + v Delta (the SDE step at noise level a = 0, as flow_grpo's and MixGRPO's ODE steps), carry no
log-prob and are not trained (the batch's `trainable`). Without a training step (evaluation), every stochastic
step is an SDE step, as without a window.
"""
from __future__ import annotations

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import FlowSDESamplerConfig, SchedulerConfig
from steadyrl.rollout.policy import Cond
from steadyrl.rollout.sampler import ConditionalModel, GaussianStepSampler, StepDistribution
from steadyrl.rollout.sde_window import window_mask

__all__ = ["FlowSDESampler", "flow_sigmas", "flow_noise_level"]


def flow_sigmas(cfg: FlowSDESamplerConfig, scheduler: SchedulerConfig, model_scheduler: dict | None = None,
                image_seq_len: int | None = None) -> tuple[Tensor, Tensor]:
    """(sigmas [T+1] float64, from 1 down to 0; model timesteps [T]) of diffusers' flow-matching scheduler.

    Default (SD3 and the digits testbed): `FlowMatchEulerDiscreteScheduler(shift=cfg.shift).set_timesteps(T)`.
    With `model_scheduler` (a FLUX pipeline's scheduler config): FluxPipeline's grid, sigmas
    linspace(1, 1/T, T) shifted by the config's static shift, or, with `use_dynamic_shifting`, by
    mu = calculate_shift(image_seq_len) (larger images spend more steps at high noise)."""
    if model_scheduler is None:
        sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=scheduler.num_train_timesteps, shift=cfg.shift)
        sched.set_timesteps(cfg.num_steps)
        return sched.sigmas.double().clone(), sched.timesteps.clone()
    import numpy as np
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    sched = FlowMatchEulerDiscreteScheduler.from_config(model_scheduler)
    mu = None
    if sched.config.use_dynamic_shifting:
        if image_seq_len is None:
            raise ValueError("a dynamically shifted flow grid needs the image's token count (image_seq_len)")
        mu = calculate_shift(image_seq_len, sched.config.get("base_image_seq_len", 256),
                             sched.config.get("max_image_seq_len", 4096), sched.config.get("base_shift", 0.5),
                             sched.config.get("max_shift", 1.15))
    sched.set_timesteps(sigmas=np.linspace(1.0, 1 / cfg.num_steps, cfg.num_steps), mu=mu)
    return sched.sigmas.double().clone(), sched.timesteps.clone()


def flow_noise_level(sigmas: Tensor, noise_level: float) -> Tensor:
    """sigma_s = a * sqrt(s / (1 - s')) at each current grid value s = sigmas[:-1] ([T], float64);
    s' = s except at s == 1, where s' = sigmas[1] (the next grid value) keeps it finite."""
    s = sigmas[:-1]
    s_denominator = torch.where(s == 1, sigmas[1], s)
    return noise_level * torch.sqrt(s / (1 - s_denominator))


class FlowSDESampler(GaussianStepSampler):
    """The velocity model's flow-matching grid as a per-step Gaussian policy (Flow-GRPO's SDE).

    Attributes ([T]): sigmas [T+1] (grid, float64), timesteps (model timesteps), noise_level
    (sigma_s, float64), delta (s_next - s < 0, float64), std (sigma_s sqrt|Delta|, float64),
    dt (|Delta|, float64), trainable (std >= cfg.min_std).
    """

    def __init__(self, cfg: FlowSDESamplerConfig, scheduler: SchedulerConfig, model_scheduler: dict | None = None,
                 image_seq_len: int | None = None):
        self.cfg = cfg
        self.sigmas, self.timesteps = flow_sigmas(cfg, scheduler, model_scheduler, image_seq_len)  # [T+1], [T]
        self.delta = self.sigmas[1:] - self.sigmas[:-1]  # [T], < 0
        self.noise_level = flow_noise_level(self.sigmas, cfg.noise_level)  # [T]
        self.dt = self.delta.abs()
        self.std = self.noise_level * self.dt.sqrt()  # [T], float64
        self.trainable = self.std >= cfg.min_std  # [T]
        if not bool(torch.isfinite(self.std).all()):
            raise ValueError(f"flow-SDE step stds are not finite: {self.std.tolist()}")
        if cfg.sde_window is not None:
            window_mask(cfg.sde_window, self.trainable, 0)  # the window fits the stochastic steps (or a clear error)

    def velocity(self, policy: ConditionalModel, x_t: Tensor, step: Tensor, cond: Cond) -> Tensor:
        """v(x_t, s, cond) at grid indices `step` [B]: the model called at timestep s * num_train_timesteps
        (`self.timesteps[step]`); x_t may be any point at grid value s = sigmas[step] (forward-process objectives)."""
        return policy(x_t, self.timesteps[step].to(x_t.device), cond)

    def step_distribution(self, policy: ConditionalModel, x_t: Tensor, step: Tensor, cond: Cond) -> StepDistribution:
        """N(x + [v + sigma_s^2/(2s) (x + (1-s) v)] Delta, (sigma_s sqrt|Delta|)^2 I), in x_t's dtype."""
        s, delta = self._coef(self.sigmas, step, x_t), self._coef(self.delta, step, x_t)
        noise_var = self._coef(self.noise_level, step, x_t) ** 2
        v = self.velocity(policy, x_t, step, cond)
        # x + (1 - s) v is the predicted noise eps_hat; the correction is the score term of the SDE.
        mean = x_t + (v + noise_var / (2 * s) * (x_t + (1 - s) * v)) * delta
        return StepDistribution(mean, self.std[step].to(device=x_t.device, dtype=x_t.dtype))

    def ode_mean(self, policy: ConditionalModel, x_t: Tensor, step: Tensor, cond: Cond) -> Tensor:
        """The Euler step of the probability-flow ODE: x_next = x + v Delta (the SDE mean at a = 0)."""
        v = policy(x_t, self.timesteps[step].to(x_t.device), cond)
        return x_t + v * self._coef(self.delta, step, x_t)

    @property
    def windowed(self) -> bool:
        """Training rollouts use an SDE window (they need the training step: `sample(..., train_step=k)`)."""
        return self.cfg.sde_window is not None

    def sde_steps(self, train_step: int | None, window_seed: int = 0) -> Tensor:
        """[T] bool: the SDE (trained) steps of a rollout at training step `train_step` (None: all stochastic)."""
        if self.cfg.sde_window is None or train_step is None:
            return self.trainable.clone()
        return window_mask(self.cfg.sde_window, self.trainable, train_step, window_seed)

    def sample(self, policy: ConditionalModel, cond: Tensor, n_per_cond: int, generator: torch.Generator, *,
               train_step: int | None = None, window_seed: int = 0, **options) -> RolloutBatch:
        """`GaussianStepSampler.sample` with the SDE window of training step `train_step` (`window_seed`: the run
        seed, for a random window); `train_step=None` (evaluation) samples every stochastic step from the SDE."""
        return super().sample(policy, cond, n_per_cond, generator, sde_steps=self.sde_steps(train_step, window_seed),
                              **options)
