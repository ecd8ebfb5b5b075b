"""Plain builders from a run's config, shared by the actors and the in-process benchmarks (no Ray here)."""
from __future__ import annotations

from torch import nn

from steadyrl.services.config import TrainConfig


def build_learner(cfg: TrainConfig, policy: nn.Module, sampler=None):
    """The DeepSpeed learner for `cfg` (its rank's environment must be set) with the testbed's sampler
    (default: the testbed's, `Testbed.build_sampler`); reward back-propagation objectives get the testbed's
    training reward as a differentiable function (a testbed without one is refused when the config loads)."""
    from steadyrl.services.testbeds import build_testbed
    from steadyrl.trainer.builders import build_deepspeed_learner
    from steadyrl.trainer.objectives import objective_class

    backprop = objective_class(cfg.objective.name).update_path == "reward_backprop"
    sampler = sampler if sampler is not None else build_testbed(cfg).build_sampler()
    # the objective, the prepared policy, its reference and the optimiser are built in trainer/builders.py
    return build_deepspeed_learner(policy, sampler, cfg.objective, cfg.learner, seed=cfg.run.seed,
                                   reward_fn=cfg.testbed.differentiable_reward() if backprop else None,
                                   compile_cfg=cfg.compile)
