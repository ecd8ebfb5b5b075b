"""An independent transcription of MixGRPO's sampling path, for tests (Tencent-Hunyuan/MixGRPO at commit
e5cdd6a427778d8c8b2e7a48ce16972141adbe7c, fastvideo/utils/sampling_utils.py: `sd3_time_shift`, `run_sample_step`,
`flow_grpo_step`, `DPMState`, `dpm_step`, `convert_model_output`, `dpm_solver_first_order_update`,
`multistep_dpm_solver_second_order_update`, `multistep_dpm_solver_third_order_update`, `_sigma_to_alpha_sigma_t`;
fastvideo/train_grpo_flux.py `sample_reference_model`: the grid and the determistic list).

Their lines, kept in their order and form, restricted to what MixGRPO / Flash / Flash* run (flow_grpo_sampling,
dpm_algorithm_type null or dpmsolver++, dpm_apply_strategy post, the ODE branches of the DPM updates), with these
changes only: tensors are float64 (their sigmas are float32; the model timestep int(sigma * 1000) is taken from a
float32 copy, as theirs); the transformer is `model(z, timestep)` with timestep = their `timesteps / 1000`; the
Gaussian noise of an SDE step comes from `noise()` and is drawn at SDE steps only (theirs draws it at every
flow_grpo_step call and discards it at deterministic ones: same samples, different RNG consumption).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable, List

import torch

F64 = torch.float64


def sd3_time_shift(shift, t):
    return (shift * t) / (1 + (shift - 1) * t)


def sigma_schedule(sampling_steps: int, shift: float) -> torch.Tensor:
    """sample_reference_model: linspace(1, 0, sampling_steps + 1), then sd3_time_shift(args.shift, .)."""
    sigma_schedule = torch.linspace(1, 0, sampling_steps + 1, dtype=F64)
    return sd3_time_shift(shift, sigma_schedule)


def determistic_list(sampling_steps: int, timesteps_train: list[int]) -> list[bool]:
    """sample_reference_model, training_strategy 'part'."""
    determistic = [True] * sampling_steps
    for i in timesteps_train:
        determistic[i] = False
    return determistic


def flow_grpo_step(model_output, latents, eta, sigmas, index, variance_noise, determistic):
    sigma = sigmas[index]
    sigma_prev = sigmas[index + 1]
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma  # neg dt
    pred_original_sample = latents - sigma * model_output
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * eta
    prev_sample_mean = latents * (1 + std_dev_t**2 / (2 * sigma) * dt) + model_output * (
        1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    if determistic:
        prev_sample = latents + dt * model_output
    else:
        prev_sample = prev_sample_mean + std_dev_t * torch.sqrt(-1 * dt) * variance_noise
    return prev_sample, pred_original_sample


@dataclass
class DPMState:
    order: int
    model_outputs: List[torch.Tensor] = None
    lower_order_nums = 0

    def __post_init__(self):
        self.model_outputs = [None] * self.order

    def update(self, model_output):
        for i in range(self.order - 1):
            self.model_outputs[i] = self.model_outputs[i + 1]
        self.model_outputs[-1] = model_output

    def update_lower_order(self):
        if self.lower_order_nums < self.order:
            self.lower_order_nums += 1


def _sigma_to_alpha_sigma_t(sigma):
    alpha_t = 1 - sigma
    sigma_t = sigma
    return alpha_t, sigma_t


def convert_model_output(model_output, sample, sigmas, step_index):
    sigma_t = sigmas[step_index]
    x0_pred = sample - sigma_t * model_output
    return x0_pred


def dpm_solver_first_order_update(args, model_output, sigmas, step_index, sample):
    sigma_t, sigma_s = sigmas[step_index + 1], sigmas[step_index]
    alpha_t, sigma_t = _sigma_to_alpha_sigma_t(sigma_t)
    alpha_s, sigma_s = _sigma_to_alpha_sigma_t(sigma_s)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s = torch.log(alpha_s) - torch.log(sigma_s)
    h = lambda_t - lambda_s
    x_t = (sigma_t / sigma_s) * sample - (alpha_t * (torch.exp(-h) - 1.0)) * model_output
    return x_t


def multistep_dpm_solver_second_order_update(args, model_output_list, sigmas, step_index, sample):
    sigma_t, sigma_s0, sigma_s1 = sigmas[step_index + 1], sigmas[step_index], sigmas[step_index - 1]
    alpha_t, sigma_t = _sigma_to_alpha_sigma_t(sigma_t)
    alpha_s0, sigma_s0 = _sigma_to_alpha_sigma_t(sigma_s0)
    alpha_s1, sigma_s1 = _sigma_to_alpha_sigma_t(sigma_s1)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    m0, m1 = model_output_list[-1], model_output_list[-2]
    h, h_0 = lambda_t - lambda_s0, lambda_s0 - lambda_s1
    r0 = h_0 / h
    D0, D1 = m0, (1.0 / r0) * (m0 - m1)
    if args.dpm_solver_type == "midpoint":
        x_t = ((sigma_t / sigma_s0) * sample
               - (alpha_t * (torch.exp(-h) - 1.0)) * D0
               - 0.5 * (alpha_t * (torch.exp(-h) - 1.0)) * D1)
    elif args.dpm_solver_type == "heun":
        x_t = ((sigma_t / sigma_s0) * sample
               - (alpha_t * (torch.exp(-h) - 1.0)) * D0
               + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * D1)
    return x_t


def multistep_dpm_solver_third_order_update(args, model_output_list, sigmas, step_index, sample):
    sigma_t, sigma_s0, sigma_s1, sigma_s2 = (sigmas[step_index + 1], sigmas[step_index], sigmas[step_index - 1],
                                             sigmas[step_index - 2])
    alpha_t, sigma_t = _sigma_to_alpha_sigma_t(sigma_t)
    alpha_s0, sigma_s0 = _sigma_to_alpha_sigma_t(sigma_s0)
    alpha_s1, sigma_s1 = _sigma_to_alpha_sigma_t(sigma_s1)
    alpha_s2, sigma_s2 = _sigma_to_alpha_sigma_t(sigma_s2)
    lambda_t = torch.log(alpha_t) - torch.log(sigma_t)
    lambda_s0 = torch.log(alpha_s0) - torch.log(sigma_s0)
    lambda_s1 = torch.log(alpha_s1) - torch.log(sigma_s1)
    lambda_s2 = torch.log(alpha_s2) - torch.log(sigma_s2)
    m0, m1, m2 = model_output_list[-1], model_output_list[-2], model_output_list[-3]
    h, h_0, h_1 = lambda_t - lambda_s0, lambda_s0 - lambda_s1, lambda_s1 - lambda_s2
    r0, r1 = h_0 / h, h_1 / h
    D0 = m0
    D1_0, D1_1 = (1.0 / r0) * (m0 - m1), (1.0 / r1) * (m1 - m2)
    D1 = D1_0 + (r0 / (r0 + r1)) * (D1_0 - D1_1)
    D2 = (1.0 / (r0 + r1)) * (D1_0 - D1_1)
    x_t = ((sigma_t / sigma_s0) * sample
           - (alpha_t * (torch.exp(-h) - 1.0)) * D0
           + (alpha_t * ((torch.exp(-h) - 1.0) / h + 1.0)) * D1
           - (alpha_t * ((torch.exp(-h) - 1.0 + h) / h**2 - 0.5)) * D2)
    return x_t


def dpm_step(args, model_output, sample, step_index, timesteps, sigmas, dpm_state):
    lower_order_final = (step_index == len(timesteps) - 1)
    lower_order_second = ((step_index == len(timesteps) - 2) and len(timesteps) < 15)
    model_output = convert_model_output(model_output, sample, sigmas, step_index=step_index)
    if dpm_state is not None:
        dpm_state.update(model_output)
    if args.dpm_solver_order == 1 or dpm_state.lower_order_nums < 1 or lower_order_final:
        prev_sample = dpm_solver_first_order_update(args, model_output, sigmas, step_index, sample)
    elif args.dpm_solver_order == 2 or dpm_state.lower_order_nums < 2 or lower_order_second:
        prev_sample = multistep_dpm_solver_second_order_update(args, dpm_state.model_outputs, sigmas, step_index,
                                                               sample)
    else:
        prev_sample = multistep_dpm_solver_third_order_update(args, dpm_state.model_outputs, sigmas, step_index,
                                                              sample)
    if dpm_state is not None:
        dpm_state.update_lower_order()
    return prev_sample, model_output


def run_sample_step(args: SimpleNamespace, z: torch.Tensor, sigma_schedule: torch.Tensor,
                    model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], determistic: list[bool],
                    noise: Callable[[], torch.Tensor]):
    """Their sampling loop; returns (all_latents [B, steps + 1, ...], the model timesteps it called, the grid)."""
    all_latents = [z]
    called = []
    progress_bar = range(0, sigma_schedule.size(0) - 1)
    if "dpmsolver" in args.dpm_algorithm_type:
        dpm_state = DPMState(order=args.dpm_solver_order)
        last_false_index = next((i for i, value in enumerate(reversed(determistic)) if not value), None)
        if last_false_index is not None:
            last_false_index = len(determistic) - 1 - last_false_index
        num_post_steps = int(max((sigma_schedule.size(0) - 1 - last_false_index) * args.dpm_post_compress_ratio, 1))
        post_time_step = torch.linspace(1, 0, sigma_schedule.size(0), dtype=F64)[last_false_index + 1].item()
        post_sigma_schedule = torch.linspace(post_time_step, 0, num_post_steps, dtype=F64)
        post_sigma_schedule = sd3_time_shift(args.shift, post_sigma_schedule)
        sigma_schedule = torch.cat([sigma_schedule[:last_false_index + 1], post_sigma_schedule], dim=0)
        progress_bar = range(0, sigma_schedule.size(0) - 1)
    for i in progress_bar:
        sigma = sigma_schedule[i]
        timestep_value = int(sigma.float() * 1000)  # their sigma is float32
        timesteps = torch.full([z.shape[0]], timestep_value, dtype=torch.long)
        called.append(timestep_value)
        pred = model(z, timesteps / 1000)
        if args.dpm_algorithm_type == "null":
            z, _ = flow_grpo_step(pred, z, args.eta, sigma_schedule, i, None if determistic[i] else noise(),
                                  determistic[i])
        elif i <= last_false_index:
            x_0 = convert_model_output(pred, z, sigma_schedule, step_index=i)
            dpm_state.update(x_0)
            z, _ = flow_grpo_step(pred, z, args.eta, sigma_schedule, i, None if determistic[i] else noise(),
                                  determistic[i])
            dpm_state.update_lower_order()
        else:
            z, _ = dpm_step(args, pred, z, i, sigma_schedule[:-1], sigma_schedule, dpm_state)
        all_latents.append(z)
    return torch.stack(all_latents, dim=1), called, sigma_schedule


def flash_args(ratio: float, order: int = 2, solver_type: str = "midpoint", shift: float = 3.0,
               eta: float = 0.7) -> SimpleNamespace:
    """The Flash scripts' arguments (finetune_flux_grpo_MixGRPO_Flash.sh: ratio 0.4; Flash*: 0.2)."""
    return SimpleNamespace(dpm_algorithm_type="dpmsolver++", dpm_apply_strategy="post", dpm_post_compress_ratio=ratio,
                           dpm_solver_order=order, dpm_solver_type=solver_type, shift=shift, eta=eta)


def gaussian_velocity(x: torch.Tensor, s: torch.Tensor | float, mu: torch.Tensor, tau: float) -> torch.Tensor:
    """The exact velocity E[eps - x0 | x_s] for data x0 ~ N(mu, tau^2 I), x_s = (1 - s) x0 + s eps:
    v = (s - (1 - s) tau^2) y / D - mu, y = x - (1 - s) mu, D = (1 - s)^2 tau^2 + s^2."""
    s = torch.as_tensor(s, dtype=x.dtype).view(-1, *([1] * (x.dim() - 1))) if torch.is_tensor(s) else s
    y = x - (1 - s) * mu
    d = (1 - s) ** 2 * tau**2 + s**2
    return (s - (1 - s) * tau**2) * y / d - mu


def gaussian_flow(x: torch.Tensor, s_from: float, s_to: float, mu: torch.Tensor, tau: float) -> torch.Tensor:
    """The probability-flow ODE's exact solution from s_from to s_to: y / sqrt(D) is constant along it."""
    d = lambda s: (1 - s) ** 2 * tau**2 + s**2  # noqa: E731
    return (1 - s_to) * mu + (x - (1 - s_from) * mu) * math.sqrt(d(s_to) / d(s_from))
