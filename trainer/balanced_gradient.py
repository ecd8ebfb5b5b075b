"""BGPO's seed form ("balanced gradient") as named, individually switchable pieces (docs/objectives.md).

Each piece is plain torch on any `nn.Module` (a diffusers UNet, a transformers masked LM); nothing here
knows about Ray or DeepSpeed:

    scale_module_gradients    after backward, before clipping/step: g_i <- g_i [sqrt(d_i) / (||g_i||_2 + eps)]**alpha
                              (alpha = `scaling_strength`, linear over the run's updates; 1 by default)
    DualMomentum              the optimiser (trainer/dual_momentum.py): short/long momenta, geometric mean
    RollingQuantileClipper    A <- clip(A, -q, q), q the rolling quantile of |A| over the last `window` values
    enable_activation_checkpointing   recompute block activations in backward (memory for compute)
    apply_module_precision    per-submodule parameter dtype, inputs/outputs cast at the module boundary
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Literal

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from steadyrl.rollout.settings_base import StrictModel
from steadyrl.trainer.dual_momentum import DualMomentum
from steadyrl.trainer.linear_schedule import LinearSchedule

__all__ = ["BalancedGradientConfig", "DualMomentum", "RollingQuantileClipper", "apply_module_precision",
           "enable_activation_checkpointing", "module_groups", "scale_module_gradients"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class BalancedGradientConfig(StrictModel):
    """The seed form's options; every one is off by default, so each can be benchmarked on its own."""

    module_grad_scaling: bool = Field(
        False, description="rescale each module's gradient to norm sqrt(d_i) (d_i its elements): every module "
        "then moves by a comparable per-element amount, so modules with tiny gradients (e.g. deep blocks far from "
        "the loss) are not starved by those with large ones")
    scaling_eps: float = Field(1e-8, gt=0, description="eps in sqrt(d_i) / (||g_i|| + eps): a zero gradient stays 0")
    scaling_strength: LinearSchedule = Field(
        default_factory=LinearSchedule,
        description="alpha in g_i <- g_i * s_i**alpha, scheduled linearly over the run's updates (start -> end, in "
        "[0, 1]): 1 = full balancing (every module to norm sqrt(d_i)), 0 = none; e.g. start 1, end 0 balances the "
        "early updates, where starved modules matter most, and hands the late ones back to the raw gradient")
    scaling_depth: int = Field(
        2, ge=1, description="what counts as a module: parameters are grouped by the first `depth` components of "
        "their owning module's dotted name (depth 2: 'bert.encoder', 'down_blocks.0'); deeper = finer balancing")
    dual_momentum: bool = Field(
        False, description="use the DualMomentum optimiser instead of AdamW: an element moves only where the "
        "short- and long-horizon momenta agree in sign, damping oscillation from noisy RL gradients")
    short_horizon: float = Field(5.0, ge=1, description="short momentum horizon in steps: beta_s = 1 - 1/h "
                                 "(tracks the recent trend)")
    long_horizon: float = Field(100.0, ge=1, description="long momentum horizon in steps: beta_l = 1 - 1/h "
                                "(the persistent direction that vetoes transient flips)")
    advantage_quantile_clip: bool = Field(
        False, description="clip advantages to +-q, q a rolling quantile of |A|: a few outlier rewards cannot "
        "dominate a step, and the bound adapts to the reward's scale instead of a fixed adv_clip")
    quantile: float = Field(0.9, gt=0, le=1, description="the quantile of |A| used as the clip bound")
    quantile_window: int = Field(1000, ge=1, description="how many recent |A| values the quantile is taken over")
    activation_checkpointing: bool = Field(
        False, description="recompute block activations during backward: memory for ~one extra forward of compute, "
        "so larger micro-batches fit")
    module_precision: dict[str, Literal["fp32", "bf16", "fp16"]] = Field(
        default_factory=dict, description="dotted submodule name -> parameter dtype (e.g. {'bert.encoder': 'bf16'}): "
        "low precision where the model is large and tolerant, fp32 where it is sensitive (norms, heads); "
        "inputs/outputs are cast at each module's boundary so mixed modules compose")

    @model_validator(mode="after")
    def _horizons(self) -> BalancedGradientConfig:
        if self.short_horizon > self.long_horizon:
            raise ValueError(f"short_horizon={self.short_horizon} must be <= long_horizon={self.long_horizon}")
        bad = self.scaling_strength.bounds_error("learner.balanced.scaling_strength", 0.0, 1.0)
        if bad:
            raise ValueError(f"{bad}: alpha interpolates between no balancing (0) and full balancing (1); above 1 a "
                             "module's step would grow as its gradient shrinks")
        if not self.module_grad_scaling and self.scaling_strength != LinearSchedule():
            raise ValueError("learner.balanced.scaling_strength is set but learner.balanced.module_grad_scaling is "
                             "false: the strength schedules that scaling, so switch it on")
        return self


# ---------------------------------------------------------------------------------------- gradient scaling
def module_groups(model: nn.Module, depth: int) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Parameters grouped by the first `depth` components of their owning module's dotted name
    ('bert.encoder.layer.0.output.dense.weight', depth 2 -> 'bert.encoder'; a root parameter -> '')."""
    groups: dict[str, list[tuple[str, nn.Parameter]]] = defaultdict(list)
    for name, p in model.named_parameters():
        owner = name.split(".")[:-1]
        groups[".".join(owner[:depth])].append((name, p))
    return dict(groups)


def group_gradients(model: nn.Module, depth: int) -> dict[str, list[Tensor]]:
    """The accumulated gradients of each module group (`module_groups`) that has any."""
    groups = {name: [p.grad for _, p in params if p.grad is not None]
              for name, params in module_groups(model, depth).items()}
    return {name: grads for name, grads in groups.items() if grads}


def gradient_norm(grads: list[Tensor]) -> Tensor:
    """||g||_2 over several tensors, a float64 scalar: at least fp32 per tensor, mixed-precision tensors combined
    in fp64."""
    norms = [torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)).double() for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms))


@torch.no_grad()
def scale_module_gradients(model: nn.Module, depth: int, eps: float = 1e-8, strength: float = 1.0) -> dict[str, float]:
    """In place, per module group i: g_i <- g_i * s_i**alpha, s_i = sqrt(d_i) / (||g_i||_2 + eps), d_i the elements
    of the group's parameters that have a gradient, alpha = `strength` (1: g_i to norm ~sqrt(d_i); 0: unchanged);
    groups without any gradient are skipped. Returns each group's factor s_i**alpha."""
    names, scales = [], []
    for group, grads in group_gradients(model, depth).items():
        scale = sum(g.numel() for g in grads) ** 0.5 / (gradient_norm(grads) + eps)  # s_i
        if strength != 1.0:
            scale = scale**strength  # s_i**alpha
        for g in grads:
            g.mul_(scale.to(g.dtype))
        names.append(group)
        scales.append(scale)
    return dict(zip(names, torch.stack(scales).tolist())) if scales else {}


# ---------------------------------------------------------------------------------------- advantage clipping
class RollingQuantileClipper:
    """A <- clamp(A, -q, q), q = quantile(H, quantile) (linear interpolation), H the last `window` values of |A|
    including this call's. State: a float64 ring buffer and the count of values seen (tensors, checkpointable)."""

    def __init__(self, quantile: float = 0.9, window: int = 1000):
        if not 0 <= quantile <= 1 or window < 1:
            raise ValueError(f"need 0 <= quantile <= 1 (got {quantile}) and window >= 1 (got {window})")
        self.quantile, self.window = quantile, window
        self.buffer = torch.zeros(window, dtype=torch.float64)
        self.count = torch.zeros((), dtype=torch.int64)  # values appended so far (all time)
        self.last_q: float | None = None  # the latest bound (metrics)

    def history(self) -> Tensor:
        """The retained |A| values, oldest first."""
        n, pos = int(self.count), int(self.count) % self.window
        return self.buffer[:n].clone() if n <= self.window else torch.cat([self.buffer[pos:], self.buffer[:pos]])

    def append(self, values: Tensor) -> None:
        vals = values.detach().abs().flatten().to(self.buffer)
        keep = vals[max(0, vals.numel() - self.window):]  # older values would be overwritten anyway
        start = int(self.count) + vals.numel() - keep.numel()
        self.buffer[(start + torch.arange(keep.numel())) % self.window] = keep
        self.count += vals.numel()

    @torch.no_grad()
    def __call__(self, adv: Tensor) -> Tensor:
        self.append(adv)
        if int(self.count) == 0:
            return adv
        q = torch.quantile(self.buffer[: min(int(self.count), self.window)], self.quantile)
        self.last_q = float(q)
        return adv.clamp(-self.last_q, self.last_q)

    def state_dict(self) -> dict[str, Tensor]:
        return {"buffer": self.buffer.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        if state["buffer"].shape != self.buffer.shape:
            raise ValueError(f"window mismatch: state has {state['buffer'].numel()}, clipper {self.window}")
        self.buffer, self.count = state["buffer"].clone().to(torch.float64), state["count"].clone()


# ---------------------------------------------------------------------------------------- activation checkpointing
def enable_activation_checkpointing(model: nn.Module) -> bool:
    """Turn on the library's own block checkpointing (non-reentrant torch.utils.checkpoint): transformers'
    `activation_checkpointing_enable` / `gradient_checkpointing_enable` (checkpoints only in train mode),
    diffusers' `enable_gradient_checkpointing` (whenever grad is enabled). Returns whether a block now
    checkpoints; a model with neither method is a ValueError."""
    kwargs = {"use_reentrant": False}  # the reentrant form drops parameter grads when inputs need no grad
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the older name is deprecated)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    elif hasattr(model, "enable_gradient_checkpointing"):  # diffusers: non-reentrant by default
        model.enable_gradient_checkpointing()
    else:
        raise ValueError(f"{type(model).__name__} has no gradient_checkpointing_enable() (transformers) or "
                         "enable_gradient_checkpointing() (diffusers): activation checkpointing is unavailable")
    return any(bool(getattr(m, "gradient_checkpointing", False)) for m in model.modules())


# ---------------------------------------------------------------------------------------- per-module precision
def _cast(x: Any, dtype: torch.dtype) -> Any:
    """Floating tensors in x (tensors, tuples, namedtuples, lists, dicts) cast to dtype. A plain dict is copied;
    a dict subclass (a transformers ModelOutput, a diffusers BaseOutput: module outputs) is updated in place."""
    if isinstance(x, Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if type(x) is dict:
        return {k: _cast(v, dtype) for k, v in x.items()}
    if isinstance(x, dict):
        for k in list(x.keys()):
            x[k] = _cast(x[k], dtype)
        return x
    if isinstance(x, tuple):
        items = [_cast(v, dtype) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    if isinstance(x, list):
        return [_cast(v, dtype) for v in x]
    return x


def _float_dtype(args: tuple, kwargs: dict) -> torch.dtype:
    """The caller's float dtype: that of the first floating tensor argument, else torch's default."""
    for v in (*args, *kwargs.values()):
        if isinstance(v, Tensor) and v.is_floating_point():
            return v.dtype
    return torch.get_default_dtype()


def _hook_targets(module: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    """The modules that are called: a ModuleList/ModuleDict has no forward, so its children are hooked."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [t for child_name, child in module.named_children()
                for t in _hook_targets(child, f"{name}.{child_name}" if name else child_name)]
    return [(name, module)]


def _add_cast_hooks(module: nn.Module, dtype: torch.dtype) -> None:
    callers: list[torch.dtype] = []  # a stack: re-entrant calls (checkpoint recompute) stay balanced

    def before(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        callers.append(_float_dtype(args, kwargs))
        return _cast(args, dtype), _cast(kwargs, dtype)

    def after(mod: nn.Module, args: tuple, output: Any) -> Any:
        return _cast(output, callers.pop())

    module.register_forward_pre_hook(before, with_kwargs=True)
    module.register_forward_hook(after, always_call=True, prepend=True)  # LIFO if a module is hooked again


def apply_module_precision(model: nn.Module, spec: dict[str, str]) -> dict[str, torch.dtype]:
    """For each `name -> dtype` (name: a dotted submodule name, '' the whole model; its whole subtree):
    cast the parameters and floating buffers to dtype, and hook the module so floating inputs arrive in
    dtype and floating outputs leave in the caller's float dtype. Names are applied shallow to deep, so
    a deeper entry overrides an enclosing one. Returns the hooked modules' dtypes by name."""
    modules = dict(model.named_modules())
    hooked: dict[str, torch.dtype] = {}
    for key in sorted(spec, key=lambda k: (k.count(".") + bool(k), k)):
        if key not in modules:
            raise ValueError(f"module_precision key {key!r} matches no submodule of {type(model).__name__}")
        if spec[key] not in DTYPES:
            raise ValueError(f"module_precision[{key!r}]={spec[key]!r}: expected one of {sorted(DTYPES)}")
        modules[key].to(DTYPES[spec[key]])
        hooked.update({name: DTYPES[spec[key]] for name, _ in _hook_targets(modules[key], key)})
    for name, dtype in hooked.items():  # one hook pair per module: a deeper entry replaced an enclosing one
        _add_cast_hooks(modules[name], dtype)
    return hooked
