"""Dual-momentum optimiser (BGPO seed form): a short and a long gradient EMA combined by a signed
geometric mean, with Adam's second-moment normalisation and decoupled weight decay.

Per parameter, at step t with gradient g (all operations elementwise):

    m_s <- beta_s m_s + (1 - beta_s) g,     beta_s = 1 - 1/short_horizon
    m_l <- beta_l m_l + (1 - beta_l) g,     beta_l = 1 - 1/long_horizon
    v   <- beta2  v   + (1 - beta2)  g^2
    m_s^ = m_s / (1 - beta_s^t),  m_l^ = m_l / (1 - beta_l^t),  v^ = v / (1 - beta2^t)
    u    = sign(m_s^) sqrt(m_s^ m_l^)  where sign(m_s^) == sign(m_l^), else 0
         = sign(m_s) sqrt(max(m_s m_l, 0) / ((1 - beta_s^t)(1 - beta_l^t)))
    p   <- p (1 - lr weight_decay) - lr u / (sqrt(v^) + eps)

An element moves only where the recent (short) and the persistent (long) trend agree in direction, by
the geometric mean of their sizes. With short_horizon == long_horizon, u = m^ and this is AdamW with
beta1 = 1 - 1/horizon. A `torch.optim.Optimizer`, so DeepSpeed takes it as a client optimiser.
State per parameter: `step`, `m_short`, `m_long`, `v` (same dtype as the parameter, as torch's Adam).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import Tensor


class DualMomentum(torch.optim.Optimizer):
    """p <- p (1 - lr wd) - lr u / (sqrt(v^) + eps), u the signed geometric mean of short/long momenta."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict], lr: float = 1e-4, short_horizon: float = 5.0,
                 long_horizon: float = 100.0, beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0):
        if lr < 0:
            raise ValueError(f"lr={lr} must be >= 0")
        if not 1 <= short_horizon <= long_horizon:
            raise ValueError(f"need 1 <= short_horizon ({short_horizon}) <= long_horizon ({long_horizon})")
        if not 0 <= beta2 < 1:
            raise ValueError(f"beta2={beta2} must be in [0, 1)")
        if eps <= 0 or weight_decay < 0:
            raise ValueError(f"need eps > 0 (got {eps}) and weight_decay >= 0 (got {weight_decay})")
        defaults = {"lr": lr, "short_horizon": short_horizon, "long_horizon": long_horizon, "beta2": beta2,
                    "eps": eps, "weight_decay": weight_decay}
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd, beta2 = group["lr"], group["eps"], group["weight_decay"], group["beta2"]
            beta_s, beta_l = 1 - 1 / group["short_horizon"], 1 - 1 / group["long_horizon"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("DualMomentum does not support sparse gradients")
                self._update(p, p.grad, lr, beta_s, beta_l, beta2, eps, wd)
        return loss

    def _update(self, p: Tensor, g: Tensor, lr: float, beta_s: float, beta_l: float, beta2: float, eps: float,
                wd: float) -> None:
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            for key in ("m_short", "m_long", "v"):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t = int(state["step"].item())
        m_s, m_l, v = state["m_short"], state["m_long"], state["v"]
        m_s.lerp_(g, 1 - beta_s)
        m_l.lerp_(g, 1 - beta_l)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias = (1 - beta_s**t) * (1 - beta_l**t)
        u = (m_s * m_l).clamp_(min=0).div_(bias).sqrt_().mul_(m_s.sign())  # 0 where the signs differ
        denom = (v.sqrt() / (1 - beta2**t) ** 0.5).add_(eps)
        p.mul_(1 - lr * wd)
        p.addcdiv_(u, denom, value=-lr)
