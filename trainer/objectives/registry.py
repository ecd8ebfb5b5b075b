"""The objective registry: each objective class registers under its name with its own settings."""
from __future__ import annotations

from typing import Callable, TypeVar

from steadyrl.trainer.objectives.base import Objective, ObjectiveSettings

_REGISTRY: dict[str, type[Objective]] = {}
O = TypeVar("O", bound=type[Objective])


def register(name: str) -> Callable[[O], O]:
    """Class decorator: `@register("grpo")` on an Objective subclass whose `Settings.name` is Literal[name]."""

    def deco(cls: O) -> O:
        if name in _REGISTRY:
            raise ValueError(f"objective {name!r} registered twice")
        if cls.Settings.model_fields["name"].default != name:
            raise ValueError(f"{cls.__name__}.Settings.name must default to {name!r}")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def objective_class(name: str) -> type[Objective]:
    if name not in _REGISTRY:
        raise ValueError(f"objective.name={name!r} is not registered; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def build_objective(cfg: ObjectiveSettings) -> Objective:
    """The objective named by `cfg.name`, holding its settings (and, from then on, its state)."""
    cls = objective_class(cfg.name)
    if not isinstance(cfg, cls.Settings):
        raise TypeError(f"objective {cfg.name!r} needs {cls.Settings.__name__}, got {type(cfg).__name__}")
    return cls(cfg)


def available() -> list[str]:
    return sorted(_REGISTRY)


def settings_types() -> dict[str, type[ObjectiveSettings]]:
    """name -> settings model, for the config's discriminated union."""
    return {name: cls.Settings for name, cls in sorted(_REGISTRY.items())}
