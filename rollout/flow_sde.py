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
step is an SDE step, as without a window. With `sde_window.after = "dpm_solver++"` (MixGRPO-Flash, Flash*) the steps
after the window's last SDE step are instead solved by multistep DPM-Solver++ on a compressed grid
(rollout/dpm_solver.py, rollout/flow_grid.py); the batch's states after the window's end are then its final sample.
`cfg.grid = "sd3_time_shift"` samples on MixGRPO's grid, and `cfg.integer_timesteps` calls the model at
int(sigma * 1000) as MixGRPO does.

With `cfg.sde_type = "cps"` (Coefficients-Preserving Sampling, arXiv 2509.05952; flow_grpo's `sde_type == "cps"`
branch of `sde_step_with_logprob`, the step of its Flow-GRPO-Fast presets) each stochastic step is instead

    std     = s_next * sin(a pi / 2)
    x0_hat  = x - s v,   eps_hat = x + (1 - s) v
    mean    = x0_hat (1 - s_next) + eps_hat sqrt(s_next^2 - std^2)
    x_next  = mean + std z,  z ~ N(0, I)
    log pi  = -(x_next - mean)^2, reduced over pixels   (flow_grpo: "remove all constants")

so x_next's coefficients stay the flow's (1 - s_next) on x0 and s_next on the noise.  Its "log-prob" is not the
Gaussian log-density: constants and the 1/(2 std^2) scale are dropped, so log-ratios are 2 std^2 times the Gaussian
ones.  The last step (s_next = 0) has std 0: deterministic.  At a = 0 the step is the Euler step x + v Delta.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import FlowSDESamplerConfig, SchedulerConfig
from steadyrl.rollout.dpm_solver import DPMSolverPPTail
from steadyrl.rollout.flow_grid import integer_timesteps, post_window_sigmas, static_shift, time_shift_sigmas
from steadyrl.rollout.policy import Cond
from steadyrl.rollout.sampler import ConditionalModel, GaussianStepSampler, StepDistribution, reduce_pixels
from steadyrl.rollout.sde_window import WindowedSteps, window_mask

__all__ = ["FlowSDESampler", "flow_sigmas", "flow_noise_level", "cps_std", "cps_step", "cps_logp",
           "CPSStepDistribution"]


def flow_sigmas(cfg: FlowSDESamplerConfig, scheduler: SchedulerConfig, model_scheduler: dict | None = None,
                image_seq_len: int | None = None) -> tuple[Tensor, Tensor]:
    """(sigmas [T+1] float64, from 1 down to 0; model timesteps [T]) of diffusers' flow-matching scheduler.

    Default (SD3 and the digits testbed): `FlowMatchEulerDiscreteScheduler(shift=cfg.shift).set_timesteps(T)`.
    With `model_scheduler` (a FLUX pipeline's scheduler config): FluxPipeline's grid, sigmas
    linspace(1, 1/T, T) shifted by the config's static shift, or, with `use_dynamic_shifting`, by
    mu = calculate_shift(image_seq_len) (larger images spend more steps at high noise).
    With `cfg.grid = "sd3_time_shift"`: MixGRPO's sd3_time_shift(cfg.shift, linspace(1, 0, T + 1)), whatever the
    model's scheduler (rollout/flow_grid.py), timesteps sigma * num_train_timesteps in float32."""
    if cfg.grid == "sd3_time_shift":
        sigmas = time_shift_sigmas(cfg.num_steps, cfg.shift)  # [T+1]: shift t / (1 + (shift - 1) t), t = 1 - k/T
        return sigmas, sigmas[:-1].float() * scheduler.num_train_timesteps
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


def cps_std(sigmas: Tensor, noise_level: float) -> Tensor:
    """CPS's per-step std ([T], float64) on the grid `sigmas` [T+1]: std = s_next * sin(a pi / 2)."""
    return sigmas[1:] * math.sin(noise_level * math.pi / 2)  # std_k = s_{k+1} sin(a pi / 2)


def cps_step(x: Tensor, v: Tensor, s: Tensor, s_next: Tensor, std: Tensor) -> Tensor:
    """The CPS step's mean from x at grid value s to s_next (s, s_next, std broadcast over x):
    x0_hat (1 - s_next) + eps_hat sqrt(s_next^2 - std^2), with x0_hat = x - s v and eps_hat = x + (1 - s) v."""
    x0_hat = x - s * v  # predicted x_0
    eps_hat = x + (1 - s) * v  # predicted noise (x_1)
    return x0_hat * (1 - s_next) + eps_hat * torch.sqrt(s_next**2 - std**2)  # mean of x_next


def cps_logp(x_next: Tensor, mean: Tensor, reduce: str) -> Tensor:
    """flow_grpo's CPS log-prob [B]: red(-(x_next - mean)^2), `red` the pixel mean or sum. Not the Gaussian
    log-density: its constants and the 1/(2 std^2) scale are dropped (log-ratios are 2 std^2 times the Gaussian's)."""
    return reduce_pixels(-((x_next - mean) ** 2), reduce)  # -(x_next - mean)^2, reduced over pixels


@dataclass
class CPSStepDistribution(StepDistribution):
    """A CPS step: x_next ~ N(mean, std^2 I) as sampled, scored by `cps_logp` (the rollout's and the recompute's)."""

    def log_prob(self, x_next: Tensor, reduce: str) -> Tensor:
        return cps_logp(x_next, self.mean, reduce)


class FlowSDESampler(WindowedSteps, GaussianStepSampler):
    """The velocity model's flow-matching grid as a per-step Gaussian policy (Flow-GRPO's SDE).

    Attributes ([T]): sigmas [T+1] (grid, float64), timesteps (model timesteps), noise_level
    (sigma_s, float64; used by sde_type=sde), delta (s_next - s < 0, float64), std (sde: sigma_s sqrt|Delta|;
    cps: s_next sin(a pi / 2); float64), dt (|Delta|, float64), trainable (std >= cfg.min_std).
    """

    def __init__(self, cfg: FlowSDESamplerConfig, scheduler: SchedulerConfig, model_scheduler: dict | None = None,
                 image_seq_len: int | None = None):
        self.cfg = cfg
        self.sigmas, self.timesteps = flow_sigmas(cfg, scheduler, model_scheduler, image_seq_len)  # [T+1], [T]
        self.num_train_timesteps = scheduler.num_train_timesteps
        if cfg.integer_timesteps:  # MixGRPO: the model at int(sigma * 1000), the steps on sigma
            self.timesteps = integer_timesteps(self.sigmas[:-1], self.num_train_timesteps)
        self.grid_shift = static_shift(cfg.grid, cfg.shift, model_scheduler)  # None: dynamically shifted
        if cfg.sde_window is not None and cfg.sde_window.after == "dpm_solver++" and self.grid_shift is None:
            raise ValueError("sampler.sde_window.after=dpm_solver++ compresses the grid after the window by MixGRPO's "
                             "statically shifted formula; this model's grid is dynamically shifted: set "
                             "sampler.grid=sd3_time_shift (MixGRPO's grid) and sampler.shift")
        self.delta = self.sigmas[1:] - self.sigmas[:-1]  # [T], < 0
        self.noise_level = flow_noise_level(self.sigmas, cfg.noise_level)  # [T]
        self.dt = self.delta.abs()
        if cfg.sde_type == "cps":
            self.std = cps_std(self.sigmas, cfg.noise_level)  # [T], float64: s_next sin(a pi / 2)
        else:
            self.std = self.noise_level * self.dt.sqrt()  # [T], float64: sigma_s sqrt|Delta|
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
        """sde: N(x + [v + sigma_s^2/(2s) (x + (1-s) v)] Delta, (sigma_s sqrt|Delta|)^2 I); cps: N(`cps_step`,
        (s_next sin(a pi / 2))^2 I) scored by `cps_logp`. In x_t's dtype."""
        s, delta = self._coef(self.sigmas, step, x_t), self._coef(self.delta, step, x_t)
        v = self.velocity(policy, x_t, step, cond)
        if self.cfg.sde_type == "cps":
            std = self._coef(self.std, step, x_t)
            mean = cps_step(x_t, v, s, self._coef(self.sigmas, step + 1, x_t), std)
            return CPSStepDistribution(mean, std.flatten())
        noise_var = self._coef(self.noise_level, step, x_t) ** 2
        # x + (1 - s) v is the predicted noise eps_hat; the correction is the score term of the SDE.
        mean = x_t + (v + noise_var / (2 * s) * (x_t + (1 - s) * v)) * delta
        return StepDistribution(mean, self.std[step].to(device=x_t.device, dtype=x_t.dtype))

    def ode_mean(self, policy: ConditionalModel, x_t: Tensor, step: Tensor, cond: Cond) -> Tensor:
        """The Euler step of the probability-flow ODE: x_next = x + v Delta (the SDE mean at a = 0)."""
        v = policy(x_t, self.timesteps[step].to(x_t.device), cond)
        return x_t + v * self._coef(self.delta, step, x_t)

    def tail_solver(self, sde: Tensor) -> DPMSolverPPTail | None:
        """The DPM-Solver++ tail after the SDE steps `sde` [T] (sde_window.after=dpm_solver++), from the step after
        the last SDE step to 0 on MixGRPO's compressed grid; None with after=euler or when the window ends the grid."""
        w = self.cfg.sde_window
        if w is None or w.after != "dpm_solver++" or not bool(sde.any()):
            return None
        first = int(torch.nonzero(sde).max()) + 1  # the point after the window's last SDE step
        if first >= len(self.timesteps):
            return None
        post = post_window_sigmas(self.sigmas, first, self.grid_shift, w.dpm_post_compress_ratio)  # [M], to 0
        if self.cfg.integer_timesteps:
            timesteps = integer_timesteps(post[:-1], self.num_train_timesteps)
        else:
            timesteps = post[:-1].float() * self.num_train_timesteps
        return DPMSolverPPTail(torch.cat([self.sigmas[:first], post]), first, timesteps, w.dpm_solver_order,
                               w.dpm_solver_type)

    def sample(self, policy: ConditionalModel, cond: Tensor, n_per_cond: int, generator: torch.Generator, *,
               train_step: int | None = None, window_seed: int = 0, **options) -> RolloutBatch:
        """`GaussianStepSampler.sample` with the SDE window of training step `train_step` (`window_seed`: the run
        seed, for a random window) and, with sde_window.after=dpm_solver++, the DPM-Solver++ tail after it;
        `train_step=None` (evaluation) samples every stochastic step from the SDE."""
        sde = self.sde_steps(train_step, window_seed)
        tail = None if train_step is None else self.tail_solver(sde)
        if tail is not None:
            policy = tail.watch(policy)  # records the head's last predictions: the tail's multistep history
        return super().sample(policy, cond, n_per_cond, generator, sde_steps=sde, tail=tail, **options)
