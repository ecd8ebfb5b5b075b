"""Objectives, registered by name (`grpo`, later `stabledrl.paper`, `bgpo.paper`, ...)."""
from trainer.objectives.registry import Objective, StepInputs, available, get_objective, register
from trainer.objectives import grpo  # noqa: F401  (registers "grpo")

__all__ = ["Objective", "StepInputs", "available", "get_objective", "register"]
