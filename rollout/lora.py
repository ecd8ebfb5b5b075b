"""LoRA adapters (peft) on a policy's network: the default way to train a large model.

    W x  ->  W x + (alpha / r) B A x        A [r, in] random, B [out, r] = 0 at the start

Only A and B train: the optimiser, the learner -> rollout weight sync and the checkpoint carry megabytes,
not the gigabytes of the frozen base, and the reference policy is the same network with the adapters'
reference values swapped in (at the start B = 0: exactly the base model, "adapters off").
"""
from __future__ import annotations

import torch
from pydantic import Field

from steadyrl.rollout.policy import AdaptableNetwork
from steadyrl.rollout.settings_base import StrictModel


class LoRAConfig(StrictModel):
    """Low-rank adapters on the denoiser's attention projections (or any named linear/conv modules)."""

    rank: int = Field(8, ge=1, le=1024, description="r: adapter rank (DDPO SD1.5: 4; Flow-GRPO SD3.5: 32)")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / r (Flow-GRPO SD3.5: 64 at r = 32)")
    target_modules: list[str] | None = Field(
        None, description="module-name suffixes that get adapters; None: the model family's attention "
        "projections (to_q, to_k, to_v, to_out.0, and SD3's add_*_proj / to_add_out)")
    dropout: float = Field(0.0, ge=0, lt=1, description="LoRA dropout; 0 keeps the log-prob recompute exact")
    init_seed: int = Field(0, description="seed of A's random initialisation (B starts at 0 whatever it is)")


def add_lora(policy: AdaptableNetwork, cfg: LoRAConfig, targets: list[str] | str) -> AdaptableNetwork:
    """Inject adapters into `targets` of `policy.net` in place (peft's `target_modules`: module-name suffixes, or
    a regex matched whole: the caller resolves `cfg.target_modules` against its family's default); freeze
    everything else; the policy then trains, syncs and checkpoints only the adapters
    (`AdaptableNetwork.trained_keys`). The global RNG is left as it was."""
    from peft import LoraConfig, inject_adapter_in_model

    peft_cfg = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=targets, lora_dropout=cfg.dropout,
                          init_lora_weights=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.init_seed)
        try:
            inject_adapter_in_model(peft_cfg, policy.net)
        except ValueError as err:  # peft: "Target modules ... not found in the base model"
            raise ValueError(f"lora.target_modules={targets} matched no module of "
                             f"{type(policy.net).__name__}: {err}") from None
    for name, p in policy.net.named_parameters():
        p.requires_grad_("lora_" in name)
        if "lora_" in name and p.dtype != torch.float32:  # adapters train in float32 under a bf16/fp16 base
            p.data = p.data.float()
    policy.trained_keys = frozenset(k for k in policy.net.state_dict() if "lora_" in k)
    return policy

