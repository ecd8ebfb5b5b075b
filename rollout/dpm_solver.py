"""Multistep DPM-Solver++ (Lu et al. 2022, arXiv 2211.01095) on a rectified-flow grid: MixGRPO-Flash's ODE tail.

MixGRPO-Flash and Flash* (Tencent-Hunyuan/MixGRPO, fastvideo/utils/sampling_utils.py `run_sample_step` with
--dpm_algorithm_type dpmsolver++ --dpm_apply_strategy post) sample the steps up to the SDE window's last one as
MixGRPO does (Euler, then the window's SDE steps), then finish on a compressed grid (rollout/flow_grid.py
`post_window_sigmas`) with their own hand-written multistep DPM-Solver++ (`dpm_step` and its updates), whose history
holds the data predictions of every step before the tail. diffusers' DPMSolverMultistepScheduler has the same
update formulas but builds its own grid, starts each run at first order and drops to first order at the last step
only under conditions; it cannot take this grid or this history, so the solver is written here, after theirs.

A flow as a diffusion: x = alpha x0 + sigma eps with alpha = 1 - sigma, lambda = log(alpha / sigma); the data
prediction of a velocity model is m = x - sigma v. One step from s0 to t with h = lambda_t - lambda_s0 and earlier
predictions m1 (at s1), m2 (at s2):

    order 1   x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) m0        (the Euler step x + (sigma_t - sigma_s0) v)
    order 2   r0 = (lambda_s0 - lambda_s1) / h,  D0 = m0,  D1 = (m0 - m1) / r0
              midpoint: x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) D0 - 0.5 alpha_t (e^-h - 1) D1
              heun:     x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) D0 + alpha_t ((e^-h - 1) / h + 1) D1
    order 3   r1 = (lambda_s1 - lambda_s2) / h,  D1_0 = (m0 - m1) / r0,  D1_1 = (m1 - m2) / r1,
              D1 = D1_0 + r0 / (r0 + r1) (D1_0 - D1_1),  D2 = (D1_0 - D1_1) / (r0 + r1)
              x_t = (sigma_t / sigma_s0) x - alpha_t (e^-h - 1) D0 + alpha_t ((e^-h - 1) / h + 1) D1
                    - alpha_t ((e^-h - 1 + h) / h^2 - 0.5) D2

At sigma_t = 0 (lambda_t = inf) the first-order step returns m0. The coefficients are computed in float64 and cast
to x's dtype.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Literal

import torch
from torch import Tensor, nn

from steadyrl.rollout.policy import Cond

__all__ = ["solver_order", "dpm_solver_pp_step", "dpm_solver_pp_tail", "DPMSolverPPTail"]

SolverType = Literal["midpoint", "heun"]


def _lambda(sigma: Tensor) -> Tensor:
    """lambda = log(alpha) - log(sigma), alpha = 1 - sigma (float64; +inf at sigma = 0, -inf at sigma = 1)."""
    sigma = sigma.double()
    return torch.log(1 - sigma) - torch.log(sigma)


def solver_order(step: int, n_steps: int, order: int) -> int:
    """The order their `dpm_step` uses at step `step` of an `n_steps`-step grid: 1 at the last step, with
    order 1, or with no earlier prediction (step 0); 2 with order 2, one earlier prediction (step 1), or at the
    second-to-last step of a grid under 15 steps; else 3. (Their DPMState counts every step before, so at step i
    it holds min(i, order) earlier predictions.)"""
    if order == 1 or step < 1 or step == n_steps - 1:
        return 1
    if order == 2 or step < 2 or (step == n_steps - 2 and n_steps < 15):
        return 2
    return 3


def dpm_solver_pp_step(x: Tensor, preds: list[Tensor], sigmas: Tensor, solver_type: SolverType = "midpoint") -> Tensor:
    """One DPM-Solver++ step of order len(preds) (1-3) from sigmas[1] to sigmas[0].

    preds: data predictions [m0, m1, m2], newest first, m_j at sigmas[j + 1]; sigmas: [sigma_t, sigma_s0, sigma_s1,
    sigma_s2] (the first len(preds) + 1 are used). Formulas in the module docstring."""
    order = len(preds)
    lam = _lambda(sigmas[: order + 1])
    sigma_t, sigma_s0 = sigmas[0].double(), sigmas[1].double()
    alpha_t = 1 - sigma_t
    h = lam[0] - lam[1]

    def c(value: Tensor) -> Tensor:  # a float64 coefficient on x's device and dtype
        return value.to(device=x.device, dtype=x.dtype)

    phi = torch.exp(-h) - 1.0  # e^-h - 1
    x_t = c(sigma_t / sigma_s0) * x - c(alpha_t * phi) * preds[0]  # first order: (s_t/s_0) x - a_t (e^-h - 1) m0
    if order == 1:
        return x_t
    r0 = (lam[1] - lam[2]) / h
    d1_0 = (preds[0] - preds[1]) / c(r0)  # D1 of order 2, D1_0 of order 3
    if order == 2:
        if solver_type == "midpoint":
            return x_t - c(0.5 * alpha_t * phi) * d1_0  # - 0.5 a_t (e^-h - 1) D1
        return x_t + c(alpha_t * (phi / h + 1.0)) * d1_0  # + a_t ((e^-h - 1)/h + 1) D1
    r1 = (lam[2] - lam[3]) / h
    d1_1 = (preds[1] - preds[2]) / c(r1)
    d1 = d1_0 + c(r0 / (r0 + r1)) * (d1_0 - d1_1)  # D1 = D1_0 + r0/(r0 + r1) (D1_0 - D1_1)
    d2 = (d1_0 - d1_1) / c(r0 + r1)  # D2 = (D1_0 - D1_1)/(r0 + r1)
    return (x_t + c(alpha_t * (phi / h + 1.0)) * d1
            - c(alpha_t * ((phi + h) / h**2 - 0.5)) * d2)  # + a_t((e^-h-1)/h+1) D1 - a_t((e^-h-1+h)/h^2-1/2) D2


def dpm_solver_pp_tail(velocity: Callable[[Tensor, int], Tensor], x: Tensor, history: list[Tensor], grid: Tensor,
                       first_step: int, order: int, solver_type: SolverType = "midpoint") -> list[Tensor]:
    """Steps first_step..n-1 of the n-step `grid` [n + 1] by multistep DPM-Solver++; returns the states after each.

    velocity(x, i): the model's velocity at x on grid point i. history: the data predictions of the steps just before
    first_step, oldest first (at most order - 1 are used)."""
    n_steps = len(grid) - 1
    preds: deque[Tensor] = deque(history[-(order - 1):] if order > 1 else [], maxlen=order)
    states = []
    for i in range(first_step, n_steps):
        preds.append(x - grid[i].to(device=x.device, dtype=x.dtype) * velocity(x, i))  # m = x - sigma v
        k = solver_order(i, n_steps, order)
        newest = list(reversed(preds))[:k]  # [m0, m1, m2][:k]
        if len(newest) < k:
            raise ValueError(f"step {i} is of order {k} but the history holds {len(newest) - 1} earlier predictions")
        x = dpm_solver_pp_step(x, newest, grid[i + 1 - k: i + 2].flip(0), solver_type)  # [s_t, s_0, s_1, s_2][:k+1]
        states.append(x)
    return states


class _LastPredictions(nn.Module):
    """The policy, remembering the (x, v) of its last `keep` calls (one call per sampling step)."""

    def __init__(self, policy: nn.Module, keep: int):
        super().__init__()
        self.policy = policy
        self.calls = 0
        self.kept: deque[tuple[Tensor, Tensor]] = deque(maxlen=keep)

    def forward(self, x: Tensor, t: Tensor, cond: Cond) -> Tensor:
        v = self.policy(x, t, cond)
        self.kept.append((x, v))
        self.calls += 1
        return v


class DPMSolverPPTail:
    """MixGRPO-Flash's tail of one rollout: the sampler runs steps 0..first_step-1 with the policy `watch` returns,
    then `self(x, cond)` finishes from grid[first_step] to 0 with DPM-Solver++ (no noise, no log-prob) and returns the
    final sample; the tail's states stay in `states`.

    grid [n + 1] (float64): the sampler's points up to first_step, then the compressed post-window grid;
    timesteps [n - first_step]: the model timesteps of the tail's points (before 0)."""

    def __init__(self, grid: Tensor, first_step: int, timesteps: Tensor, order: int, solver_type: SolverType):
        if len(timesteps) != len(grid) - 1 - first_step:
            raise ValueError(f"{len(timesteps)} tail timesteps for {len(grid) - 1 - first_step} tail steps")
        self.grid, self.first_step, self.timesteps = grid, first_step, timesteps
        self.order, self.solver_type = order, solver_type
        self.states: list[Tensor] = []
        self._watched: _LastPredictions | None = None

    def watch(self, policy: nn.Module) -> nn.Module:
        """The policy to sample the head with: it records the last predictions, the tail's multistep history."""
        self._watched = _LastPredictions(policy, keep=max(self.order - 1, 0))
        return self._watched

    def __call__(self, x: Tensor, cond: Cond) -> Tensor:
        w = self._watched
        if w is None or w.calls != self.first_step:
            raise RuntimeError(f"the tail starts at step {self.first_step}: sample steps 0..{self.first_step - 1} "
                               "with the policy `watch` returned, one call per step")
        first_kept = self.first_step - len(w.kept)
        history = [xk - self.grid[first_kept + j].to(device=xk.device, dtype=xk.dtype) * vk  # m = x - sigma v
                   for j, (xk, vk) in enumerate(w.kept)]

        def velocity(x_i: Tensor, i: int) -> Tensor:
            t = self.timesteps[i - self.first_step].to(x_i.device).expand(len(x_i))
            return w.policy(x_i, t, cond)

        self.states = dpm_solver_pp_tail(velocity, x, history, self.grid, self.first_step, self.order,
                                         self.solver_type)
        return self.states[-1]
