"""DDIM (eta > 0) as a Gaussian policy per inference step, with exact log-probabilities.

For inference step k with model timestep t and previous timestep t_prev (DDPO):
    x0_hat = (x_t - sqrt(1 - a_t) * eps) / sqrt(a_t)
    sigma  = eta * sqrt((1 - a_prev) / (1 - a_t)) * sqrt(1 - a_t / a_prev)
    mu     = sqrt(a_prev) * x0_hat + sqrt(1 - a_prev - sigma^2) * eps
    x_prev ~ N(mu, sigma^2 I)
where a = alphas_cumprod.  Steps with sigma < min_std (with diffusers' defaults, the last one)
are deterministic: they carry no log-prob and are never trained.

With `cfg.sde_window` (MixGRPO's and Flow-GRPO-Fast's window, on DDIM) a training rollout draws only the window's
steps with sigma as above (rollout/sde_window.py places them by training step); its other steps are deterministic
DDIM (eta = 0: mu = sqrt(a_prev) x0_hat + sqrt(1 - a_prev) eps), carry no log-prob and are not trained. An
evaluation (no training step) samples every step as without a window.
"""
from __future__ import annotations

import torch
from diffusers import DDIMScheduler
from torch import Tensor

from steadyrl.rollout.config import DDIMSamplerConfig
from steadyrl.rollout.policy import Cond
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.sampler import ConditionalModel, GaussianStepSampler, StepDistribution, gaussian_logp
from steadyrl.rollout.sde_window import WindowedSteps, window_mask

__all__ = ["DDIMLogProbSampler", "gaussian_logp"]


class DDIMLogProbSampler(WindowedSteps, GaussianStepSampler):
    """The epsilon-prediction UNet's DDIM schedule as a per-step Gaussian policy."""

    def __init__(self, cfg: DDIMSamplerConfig, scheduler: DDIMScheduler):
        self.cfg = cfg
        sched = DDIMScheduler.from_config(scheduler.config)
        sched.set_timesteps(cfg.num_steps)
        self.timesteps = sched.timesteps.clone().long()  # [T], descending
        n_train = sched.config.num_train_timesteps
        stride = n_train // cfg.num_steps
        alphas = sched.alphas_cumprod.double()
        prev = self.timesteps - stride
        final = torch.tensor(float(sched.final_alpha_cumprod), dtype=torch.float64)
        self.alpha_t = alphas[self.timesteps]
        self.alpha_prev = torch.where(prev >= 0, alphas[prev.clamp(min=0)], final)
        var = (1 - self.alpha_prev) / (1 - self.alpha_t) * (1 - self.alpha_t / self.alpha_prev)
        self.std = cfg.eta * var.clamp(min=0).sqrt()  # [T], float64
        self.dt = torch.full((len(self.timesteps),), stride / n_train, dtype=torch.float64)  # [T]: t -> t - stride
        self.trainable = self.std >= cfg.min_std  # [T]
        if cfg.sde_window is not None:
            window_mask(cfg.sde_window, self.trainable, 0)  # the window fits the stochastic steps (or a clear error)

    def step_distribution(self, policy: ConditionalModel, x_t: Tensor, step: Tensor, cond: Cond) -> StepDistribution:
        a_t, a_prev = self._coef(self.alpha_t, step, x_t), self._coef(self.alpha_prev, step, x_t)
        std = self._coef(self.std, step, x_t)
        eps = policy(x_t, self.timesteps[step].to(x_t.device), cond)
        x0 = (x_t - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        dir_coef = (1 - a_prev - std**2).clamp(min=0).sqrt()
        return StepDistribution(a_prev.sqrt() * x0 + dir_coef * eps, std.flatten())

    def ode_mean(self, policy: ConditionalModel, x_t: Tensor, step: Tensor, cond: Cond) -> Tensor:
        """Deterministic DDIM (eta = 0): sqrt(a_prev) x0_hat + sqrt(1 - a_prev) eps."""
        a_t, a_prev = self._coef(self.alpha_t, step, x_t), self._coef(self.alpha_prev, step, x_t)
        eps = policy(x_t, self.timesteps[step].to(x_t.device), cond)
        x0 = (x_t - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        return a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps

    def sample(self, policy: ConditionalModel, cond: Tensor, n_per_cond: int, generator: torch.Generator, *,
               train_step: int | None = None, window_seed: int = 0, **options) -> RolloutBatch:
        """`GaussianStepSampler.sample` with the SDE window of training step `train_step` (`window_seed`: the run
        seed, for a random window); `train_step=None` (evaluation) samples every stochastic step with sigma."""
        return super().sample(policy, cond, n_per_cond, generator, sde_steps=self.sde_steps(train_step, window_seed),
                              **options)
