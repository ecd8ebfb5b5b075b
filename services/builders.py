"""Plain builders from a run's config, shared by the actors and the in-process benchmarks (no Ray here)."""
from __future__ import annotations

from torch import nn

from steadyrl.reward.config import differentiable_train_reward
from steadyrl.rollout.samplers import build_sampler
from steadyrl.services.config import TrainConfig


def build_learner(cfg: TrainConfig, policy: nn.Module, sampler=None):
    """The DeepSpeed learner for `cfg` (its rank's environment must be set) with the testbed's sampler
    (default: an image sampler from `cfg.sampler`); reward back-propagation objectives get the training
    reward as a differentiable function."""
    from steadyrl.trainer.learner import DeepSpeedLearner
    from steadyrl.trainer.objectives import objective_class

    backprop = objective_class(cfg.objective.name).mode == "reward_backprop"
    sampler = sampler if sampler is not None else build_sampler(cfg.sampler, cfg.scheduler)
    return DeepSpeedLearner(policy, sampler, cfg.objective, cfg.learner,
                            seed=cfg.run.seed, reward_fn=differentiable_train_reward(cfg.reward) if backprop else None)
