"""DeepSpeed's JSON config and collective backend for the learner's engine (deepspeed is imported lazily)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from steadyrl.trainer.config import LearnerConfig


def deepspeed_config(cfg: LearnerConfig, client_optimizer: bool) -> dict[str, Any]:
    """DeepSpeed JSON config. Without a `client_optimizer` (trainer/builders.py `build_optimizer` returned None)
    DeepSpeed builds AdamW from the `optimizer` section (torch's AdamW, or with `learner.fused_adam` DeepSpeed's fused
    CUDA kernel, compiled on first use); with
    one (DualMomentum) there is no optimizer section. The learner marks the gradient-accumulation boundary itself
    (last piece of each optimisation step)."""
    out = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": cfg.micro_per_optim_step,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": cfg.lr, "betas": list(cfg.betas), "weight_decay": cfg.weight_decay,
                       "torch_adam": not cfg.fused_adam},
        },
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if client_optimizer:
        del out["optimizer"]
        out["zero_allow_untested_optimizer"] = True
    return out


def communication_backend(name: str) -> str:
    """`auto`: NCCL when DeepSpeed's accelerator is cuda (DS_ACCELERATOR), gloo on the CPU."""
    if name != "auto":
        return name
    from deepspeed.accelerator import get_accelerator

    return "nccl" if get_accelerator().device_name() == "cuda" else "gloo"


def check_fused_adam(cfg: LearnerConfig) -> None:
    """`learner.fused_adam` needs DeepSpeed's accelerator to be cuda: its kernel has no CPU build."""
    if not cfg.fused_adam:
        return
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cuda":
        raise ValueError(f"learner.fused_adam=true needs a CUDA device; DeepSpeed's accelerator here is "
                         f"{get_accelerator().device_name()!r}: set learner.fused_adam=false on the CPU")


def jit_arch_list(value: str) -> str:
    """`TORCH_CUDA_ARCH_LIST` as DeepSpeed's JIT builder reads it. DeepSpeed 0.19 sorts the entries as numbers
    (`9.0` -> (9, 0)), so an architecture-specific suffix that PyTorch and nvcc accept (`9.0a`, `10.0f`, set on
    Hopper and Blackwell images) stops its build with `invalid literal for int()`: the suffix is dropped (FusedAdam
    uses no architecture-specific instruction), `+PTX` kept, separators made `;`."""
    out = []
    for entry in value.replace(" ", ";").split(";"):
        arch, plus, ptx = entry.strip().partition("+")
        if arch:
            out.append(arch.rstrip("abcdefghijklmnopqrstuvwxyz") + plus + ptx)
    return ";".join(dict.fromkeys(out))


def fused_adam_build_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment updates DeepSpeed's FusedAdam build needs in this process (empty when none)."""
    arch = environ.get("TORCH_CUDA_ARCH_LIST", "")
    return {"TORCH_CUDA_ARCH_LIST": jit_arch_list(arch)} if arch.strip() else {}
