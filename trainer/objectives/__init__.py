"""Objectives, registered by name (`grpo`, `stabledrl.paper`, `grpo_guard.paper`, `gardo.paper`, `bgpo.paper`, ...)."""
from steadyrl.trainer.objectives.base import (KLSettings, LearnerHooks, Objective, ObjectiveSettings,
                                              PolicyGradientObjective, RewardBackpropObjective, TermInputs,
                                              UpdateSchedule)
from steadyrl.trainer.objectives.registry import available, build_objective, objective_class, register, settings_types
from steadyrl.trainer.objectives import grpo, grpo_d1  # noqa: F401,E402  (registers "grpo", "grpo.d1")
from steadyrl.trainer.objectives import gardo, gardo_seed  # noqa: F401,E402  (registers "gardo.paper", "gardo.seed")
from steadyrl.trainer.objectives import grpo_guard, reward_backprop  # noqa: F401,E402  ("grpo_guard.paper", "draft", "grpo_guard.seed")
from steadyrl.trainer.objectives import stabledrl_code, stabledrl_paper  # noqa: F401,E402  (registers "stabledrl.*")
from steadyrl.trainer.objectives import bgpo  # noqa: F401,E402  (registers "bgpo.paper")
from steadyrl.trainer.objectives import diffusion_nft, gardo_nft  # noqa: F401,E402  ("diffusion_nft.*", "gardo.nft")
from steadyrl.trainer.objectives.registry import register_plugins  # noqa: E402

register_plugins()  # after the built-ins: a plug-in's name may not be one of theirs (rollout/plugins.py)

__all__ = ["KLSettings", "LearnerHooks", "Objective", "ObjectiveSettings", "PolicyGradientObjective",
           "RewardBackpropObjective", "TermInputs", "UpdateSchedule", "available", "build_objective", "objective_class", "register",
           "settings_types"]
