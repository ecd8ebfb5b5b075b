"""Plain builders of what a `DeepSpeedLearner` is given, and `build_deepspeed_learner`, the one place that wires
them (the product's `services.runtime.builders.build_learner` and the tests build learners through it):

  build_objective   the objective named by the settings (trainer/objectives/registry.py)
  prepare_network   the policy's network made ready to train: per-module precision, activation checkpointing
  build_reference   the frozen reference policy (a copy; LoRA: the live network with adapters swapped)
  build_optimizer   the client optimiser (DualMomentum), or None: DeepSpeed's own AdamW from its config
"""
from __future__ import annotations

import torch
from torch import nn

from steadyrl.rollout.compile import CompileConfig, compile_network
from steadyrl.rollout.policy import make_reference
from steadyrl.rollout.sampler import Sampler
from steadyrl.trainer.balanced_gradient import (BalancedGradientConfig, DualMomentum, apply_module_precision,
                                                enable_activation_checkpointing)
from steadyrl.trainer.config import LearnerConfig
from steadyrl.trainer.context import DifferentiableReward
from steadyrl.trainer.learner import DeepSpeedLearner
from steadyrl.trainer.objectives import ObjectiveSettings, build_objective

__all__ = ["build_deepspeed_learner", "build_objective", "build_optimizer", "build_reference", "prepare_network"]


def prepare_network(policy: nn.Module, balanced: BalancedGradientConfig) -> None:
    """`learner.balanced`'s module precision and activation checkpointing, in place, on the policy's network (a
    Policy's `net`; module names as the model has them). Before `build_reference`, which copies the result."""
    network = getattr(policy, "net", policy)
    if balanced.module_precision:
        apply_module_precision(network, balanced.module_precision)
    if balanced.activation_checkpointing:
        enable_activation_checkpointing(network)


def build_reference(policy: nn.Module) -> nn.Module:
    """The frozen reference: a copy of the policy, or (LoRA) the live network with its adapters swapped."""
    return make_reference(policy)


def build_optimizer(policy: nn.Module, cfg: LearnerConfig) -> torch.optim.Optimizer | None:
    """DualMomentum over the trained parameters with `learner.balanced.dual_momentum`; else None, and
    `deepspeed.initialize` builds AdamW (lr, betas, weight decay of `cfg`) from the config's optimizer section."""
    balanced = cfg.balanced
    if not balanced.dual_momentum:
        return None
    params = [p for p in policy.parameters() if p.requires_grad]
    return DualMomentum(params, lr=cfg.lr, short_horizon=balanced.short_horizon, long_horizon=balanced.long_horizon,
                        beta2=cfg.betas[1], weight_decay=cfg.weight_decay)


def build_deepspeed_learner(policy: nn.Module, sampler: Sampler, objective_cfg: ObjectiveSettings,
                            learner_cfg: LearnerConfig, seed: int = 0,
                            reward_fn: DifferentiableReward | None = None,
                            compile_cfg: CompileConfig | None = None) -> DeepSpeedLearner:
    """The learner for these settings: objective, prepared policy, reference and optimiser built here, in
    that order, then passed in (its rank's environment must be set). `compile_cfg.update`: the policy's network
    compiled after the reference is copied from it (the reference stays eager)."""
    objective = build_objective(objective_cfg)
    prepare_network(policy, learner_cfg.balanced)
    reference = build_reference(policy)
    if compile_cfg is not None and compile_cfg.update:
        compile_network(policy, compile_cfg)
    optimizer = build_optimizer(policy, learner_cfg)
    return DeepSpeedLearner(policy, sampler, objective, learner_cfg, reference=reference, optimizer=optimizer,
                            seed=seed, reward_fn=reward_fn)
