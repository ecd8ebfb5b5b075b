"""Plug-in packages: what an installed distribution adds to steadyrl through Python entry points.

    group                entry point                        what it names                   registry
    steadyrl.rewards     <kind> = module:SpecClass          a reward spec with `build()`    reward/factory.py
    steadyrl.objectives  <name> = module:ObjectiveClass     an `Objective` subclass         trainer/objectives/registry.py
    steadyrl.testbeds    <name> = module:TestbedClass       a `Testbed` subclass            services/testbeds/registry.py

Each registry asks for its own group once, when it is imported, after its built-ins (`load_plugins`), and builds
its config union from both. A plug-in that cannot join is left out and its problem kept, never raised at import:
an entry point that fails to import, a name a built-in or another plug-in already has, or an object that is not
what the group needs. Importing steadyrl then still works for everything else, and `load_config` raises every
problem as one `ConfigError`, before anything starts (`check_plugins`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable, Iterable

from steadyrl.rollout.settings_base import ConfigError

_LOADED: dict[str, dict[str, Any]] = {}  # group -> {name: the loaded object}
_PROBLEMS: list[str] = []


@dataclass(frozen=True)
class PluginOrigin:
    """Where a plug-in comes from: its distribution and its entry point."""

    group: str
    name: str
    target: str  # module:attribute
    dist: str

    @classmethod
    def of(cls, ep: EntryPoint) -> "PluginOrigin":
        return cls(ep.group, ep.name, ep.value, ep.dist.name if ep.dist is not None else "an unknown distribution")

    def __str__(self) -> str:
        return f"{self.dist} (entry point {self.group}:{self.name} -> {self.target})"


def load_plugins(group: str, what: str, built_in: Iterable[str],
                 problem: Callable[[str, Any], str | None]) -> dict[str, Any]:
    """{name: object} of the group's plug-ins that load and fit, in name order; once per process (cached).

    `what` names a plug-in in messages ("reward kind"), `built_in` are the names taken already, and
    `problem(name, obj)` says why a loaded object cannot join (None: it can)."""
    if group in _LOADED:
        return dict(_LOADED[group])
    taken, by_name = set(built_in), defaultdict(list)
    for ep in entry_points(group=group):
        by_name[ep.name].append(ep)
    loaded: dict[str, Any] = {}
    for name, eps in sorted(by_name.items()):
        origins = [PluginOrigin.of(ep) for ep in eps]
        if name in taken:
            _PROBLEMS.extend(f"plug-in {what} {name!r} from {o} clashes with a built-in {what}" for o in origins)
            continue
        if len(eps) > 1:
            _PROBLEMS.append(f"plug-in {what} {name!r} is offered by more than one plug-in: "
                             f"{', '.join(map(str, origins))}")
            continue
        try:
            obj = eps[0].load()
        except Exception as err:  # noqa: BLE001 - any failure of a plug-in's import is its problem, kept
            _PROBLEMS.append(f"plug-in {what} {name!r} from {origins[0]} failed to import: "
                             f"{type(err).__name__}: {err}")
            continue
        reason = problem(name, obj)
        if reason is not None:
            _PROBLEMS.append(f"plug-in {what} {name!r} from {origins[0]}: {reason}")
            continue
        loaded[name] = obj
    _LOADED[group] = loaded
    return dict(loaded)


def describe(obj: Any) -> str:
    """What an entry point names, for messages: `class X`, `function f`, or a value's type."""
    name = getattr(obj, "__qualname__", None)
    if isinstance(obj, type):
        return f"class {name}"
    return f"{type(obj).__name__} {name}" if name else f"the {type(obj).__name__} {obj!r}"[:200]


def plugin_problems() -> list[str]:
    """Every plug-in left out so far, and why."""
    return list(_PROBLEMS)


def check_plugins() -> None:
    """A `ConfigError` listing every plug-in that could not join, if any (`load_config` calls this first)."""
    if _PROBLEMS:
        raise ConfigError("plug-in packages:\n" + "\n".join(f"  {p}" for p in _PROBLEMS))
