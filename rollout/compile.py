"""`torch.compile` of the policy's network, where the model passes run: the rollout's denoiser calls and the
learner's forward and backward. The network is compiled in place (`nn.Module.compile`), so its parameters, state
dict keys, weight syncs and checkpoints stay as they were; only the calls run through the compiled graphs.

Compiled kernels fuse and reorder float operations, so a compiled pass equals the eager one to rounding, not
bitwise: compile the rollout and the update alike, or the learner's recomputed log-probs differ from the
rollout's by that rounding (`policy/rollout_logp_absdiff_max`, still far under `learner.logp_alarm`).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field
from torch import nn

from steadyrl.rollout.settings_base import StrictModel


class CompileConfig(StrictModel):
    """Which model passes run compiled, and how."""

    rollout: bool = Field(False, description="compile the network the rollout workers sample with (the denoiser "
                          "or LM calls of every sampling step and of the held-out evaluation)")
    update: bool = Field(False, description="compile the network in the learner's passes: the forward and backward "
                         "of each trained step, and the no-grad recompute of the old log-probs (the frozen "
                         "reference stays eager)")
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="torch.compile's mode: reduce-overhead adds CUDA graphs (GPU; fixed shapes), "
        "max-autotune also searches kernel configurations (long compiles)")
    dynamic: bool | None = Field(None, description="torch.compile's dynamic: None compiles the first shape "
                                 "statically and a second shape of the same call as a dynamic graph; false "
                                 "recompiles per shape (the last micro-batch, the evaluation's batch)")
    backend: str = Field("inductor", description="torch.compile's backend (inductor: C++/OpenMP on the CPU, needs "
                         "a C++ compiler; Triton on CUDA)")

    @property
    def enabled(self) -> bool:
        return self.rollout or self.update


def network_of(policy: nn.Module) -> nn.Module:
    """The module that holds the model passes: a Policy's `net`, else the module itself."""
    return getattr(policy, "net", policy)


def compile_network(policy: nn.Module, cfg: CompileConfig) -> nn.Module:
    """Compile the policy's network in place (the same module, parameters and state-dict keys); the policy.
    Build anything that copies the network (the frozen reference) before: a copy would keep calling the
    original's compiled graph.

    On the CPU inductor's layout optimisation (convolutions moved to channels-last) is turned off: with it, torch
    2.13's CPU backward of the digits UNet gives wrong gradients for most of its parameters while the forward is
    right (tests/test_compile.py compares every gradient with an eager copy's)."""
    network = network_of(policy)
    options = None
    if cfg.backend == "inductor" and next(network.parameters()).device.type == "cpu":
        import torch._inductor

        options = {**torch._inductor.list_mode_options(cfg.mode, cfg.dynamic), "layout_optimization": False}
    network.compile(backend=cfg.backend, dynamic=cfg.dynamic,
                    **({"options": options} if options is not None else {"mode": cfg.mode}))
    return policy


def is_compiled(policy: nn.Module) -> bool:
    """Whether the policy's network runs compiled (`compile_network`)."""
    return getattr(network_of(policy), "_compiled_call_impl", None) is not None


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: torch._dynamo's tally of its frame and backward compiles
    (0 before the first)."""
    from torch._dynamo.utils import calculate_time_spent

    return float(calculate_time_spent().get("total_wall_time", 0.0))
