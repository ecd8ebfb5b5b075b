"""The objective registry: each objective class registers under its name with its own settings; installed plug-in
packages add theirs (`register_plugins`)."""
from __future__ import annotations

import inspect
from typing import Callable, TypeVar

from steadyrl.rollout.plugins import describe, load_plugins
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


def _not_an_objective(name: str, obj: object) -> str | None:
    """Why an entry point of `steadyrl.objectives` cannot be objective `name` (None: it can)."""
    if not (isinstance(obj, type) and issubclass(obj, Objective)):
        return f"{describe(obj)} is not an Objective subclass (trainer/objectives/base.py)"
    settings = getattr(obj, "Settings", None)
    if not (isinstance(settings, type) and issubclass(settings, ObjectiveSettings)):
        return f"{obj.__name__}.Settings must be an ObjectiveSettings subclass"
    if settings.model_fields["name"].default != name:
        return f"{obj.__name__}.Settings must declare `name: Literal[{name!r}] = {name!r}` (the entry point's name)"
    if inspect.isabstract(obj):
        return f"{obj.__name__} leaves abstract methods unimplemented: {sorted(obj.__abstractmethods__)}"
    return None


def register_plugins() -> None:
    """Register the objectives of installed plug-in packages (entry point group `steadyrl.objectives`, each naming
    an Objective subclass by its objective name); `trainer/objectives/__init__.py` calls this after the built-ins."""
    for name, cls in load_plugins("steadyrl.objectives", "objective", _REGISTRY, _not_an_objective).items():
        if _REGISTRY.get(name) is not cls:  # a class that `@register`s itself is already in
            register(name)(cls)


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
