"""The import rules of docs/architecture.md, read from the source: each floor imports only the floors below it
(rollout < reward < trainer < run_folder < testbeds < config < serving < runtime < driver < api, the package's
front door), no module imports itself back through others, and only runtime/ and serving/ import Ray.

Imports under `if TYPE_CHECKING:` are annotations, not arrows (they never run); a function-level import is an
arrow like any other."""
from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.import_structure import circles, import_graph

ROOT = Path(__file__).resolve().parents[1]
FLOORS = ["rollout", "reward", "trainer", "services.run_folder", "services.testbeds", "services.config",
          "services.serving", "services.runtime", "services.driver", "services.api"]
RAY_WINGS = ("services.runtime", "services.serving")
GRAPH, RAY_IMPORTERS, _ = import_graph(ROOT)


def _floor(module: str) -> int:
    if module == "services":  # the package's docstring: it imports nothing and nothing imports it
        return len(FLOORS) - 1
    return max(i for i, f in enumerate(FLOORS) if module == f or module.startswith(f + "."))


def test_each_floor_imports_only_the_floors_below_it():
    upward = [f"{src} -> {dst}" for src, dsts in GRAPH.items() for dst in dsts if _floor(dst) > _floor(src)]
    assert not upward, "imports that run back up a floor:\n" + "\n".join(sorted(upward))


def test_no_module_imports_itself_back_through_others():
    found = circles(GRAPH)
    assert not found, "import circles:\n" + "\n".join(" ".join(c) for c in found)


def test_the_circle_finder_finds_a_circle():
    """The check above would pass vacuously if `circles` found none: a planted one is found."""
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_runtime_and_serving_import_ray():
    offenders = sorted(m for m in RAY_IMPORTERS if not m.startswith(RAY_WINGS))
    assert not offenders, "Ray imported outside runtime/ and serving/: " + ", ".join(offenders)
    assert "services.runtime.ray_runtime" in RAY_IMPORTERS  # the scan sees Ray where it is


@pytest.mark.parametrize("floor", FLOORS)
def test_every_floor_has_modules(floor):
    """The rule above would pass vacuously if a floor were renamed: each one is really there."""
    assert any(_floor(m) == FLOORS.index(floor) for m in GRAPH)
