"""Where a flow-SDE rollout's SDE window sits at a training step (MixGRPO, Flow-GRPO-Fast).

Positions count the sampler's stochastic steps (P of them, 0 = the noisiest); the window is positions
[start, start + size).  last = P - size is the last start that keeps the whole window on stochastic steps.
The start is a pure function of (config, training step, run seed), so a resumed or retried step, and every
rollout worker of a step, sample with the same window:

    fixed    start_k = start
    sliding  n = k // shift_every;  raw = start + stride * n                       (MixGRPO's progressive strategy)
             stop:    start_k = min(raw, last)                                     (its default: clip at the end)
             restart: start_k = start + stride * (n mod (floor((last - start) / stride) + 1))   (its roll_back)
    random   start_k ~ U{start, ..., hi}, hi = start_max (None: last), from torch.Generator seeded by
             window_seed(seed, k)                                                  (Flow-GRPO-Fast)

Flow-GRPO-Fast (flow_grpo's sd3_pipeline_with_logprob_fast.py) draws start = random.randint(lo, hi - size), both
ends inclusive, from sde_window_range = (lo, hi) = (0, num_steps // 2): start_max = num_steps // 2 - size.  It
draws once per sampling call, from each process's own Python RNG (accelerate's set_seed(seed, device_specific=True));
here one start per training step, shared by every worker (same support, same uniform law).

MixGRPO's window is range(start, min(start + size, sampling_steps - 2)): near the grid's end it shrinks and its
last two steps are never trained; here the window keeps its size (its start stops at `last`).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from steadyrl.rollout.config import SDEWindowConfig

__all__ = ["WindowedSteps", "window_start", "window_mask", "window_seed"]


def window_seed(seed: int, step: int) -> int:
    """The random window's generator seed at training step `step` (shared by every worker of the step)."""
    return (seed * 1_000_003 + step * 7919 + 17) % (2**63 - 1)


def window_start(cfg: SDEWindowConfig, n_stochastic: int, step: int, seed: int = 0) -> int:
    """The window's first position (among the `n_stochastic` stochastic steps) at training step `step`."""
    last = n_stochastic - cfg.size
    if cfg.start > last:
        off = (" (with the noise off, eta or noise_level near 0, no step is stochastic: set sampler.sde_window=null "
               "for the deterministic sampler)") if n_stochastic == 0 else ""
        raise ValueError(f"sampler.sde_window: start={cfg.start} + size={cfg.size} runs past the sampler's "
                         f"{n_stochastic} stochastic steps (steps with std >= sampler.min_std){off}")
    if step < 0:
        raise ValueError(f"training step must be >= 0, got {step}")
    if cfg.random:
        hi = last if cfg.start_max is None else cfg.start_max  # the highest start drawn, inclusive
        if hi > last:
            raise ValueError(f"sampler.sde_window: start_max={cfg.start_max} + size={cfg.size} runs past the "
                             f"sampler's {n_stochastic} stochastic steps (steps with std >= sampler.min_std)")
        gen = torch.Generator().manual_seed(window_seed(seed, step))
        return int(torch.randint(cfg.start, hi + 1, (1,), generator=gen))  # start_k ~ U{start, ..., hi}
    if cfg.shift_every is None:
        return cfg.start
    n = step // cfg.shift_every  # shifts so far
    if cfg.at_end == "stop":
        return min(cfg.start + cfg.stride * n, last)
    positions = (last - cfg.start) // cfg.stride + 1  # starts visited before the window restarts
    return cfg.start + cfg.stride * (n % positions)


def window_mask(cfg: SDEWindowConfig, stochastic: Tensor, step: int, seed: int = 0) -> Tensor:
    """[T] bool: the SDE (trained) steps at training step `step`, a window over the `stochastic` [T] steps."""
    where = torch.nonzero(stochastic).flatten()
    first = window_start(cfg, len(where), step, seed)
    mask = torch.zeros_like(stochastic, dtype=torch.bool)
    mask[where[first:first + cfg.size]] = True
    return mask


class WindowedSteps:
    """The SDE-window half of a Gaussian step sampler whose `cfg.sde_window` may be set (flow SDE, DDIM): which
    steps a training rollout draws from the SDE and trains; its other stochastic steps take the sampler's
    deterministic `ode_mean`. Needs `self.cfg` and `self.trainable` [T]."""

    cfg: Any
    trainable: Tensor

    @property
    def windowed(self) -> bool:
        """Training rollouts use an SDE window (they need the training step: `sample(..., train_step=k)`)."""
        return self.cfg.sde_window is not None

    def sde_steps(self, train_step: int | None, window_seed: int = 0) -> Tensor:
        """[T] bool: the SDE (trained) steps of a rollout at training step `train_step` (None: all stochastic)."""
        if self.cfg.sde_window is None or train_step is None:
            return self.trainable.clone()
        return window_mask(self.cfg.sde_window, self.trainable, train_step, window_seed)
