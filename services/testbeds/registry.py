"""The testbeds by name: a new testbed is its own module(s) and one line here, or an installed plug-in package's
entry point (group `steadyrl.testbeds`, rollout/plugins.py)."""
from __future__ import annotations

import inspect

from steadyrl.rollout.plugins import describe, load_plugins
from steadyrl.services.testbeds.arith.autoregressive import ArithARTestbed
from steadyrl.services.testbeds.arith.block_diffusion import ArithBDTestbed
from steadyrl.services.testbeds.arith.masked import ArithTestbed
from steadyrl.services.testbeds.base import Testbed
from steadyrl.services.testbeds.digits.testbed import DigitsTestbed
from steadyrl.services.testbeds.settings import TestbedSettings
from steadyrl.services.testbeds.text_to_image.testbed import TextToImageTestbed

TESTBEDS: dict[str, type[Testbed]] = {t.name: t for t in (
    DigitsTestbed,
    ArithTestbed,
    ArithARTestbed,
    ArithBDTestbed,
    TextToImageTestbed,
)}


def _not_a_testbed(name: str, obj: object) -> str | None:
    """Why an entry point of `steadyrl.testbeds` cannot be testbed `name` (None: it can)."""
    if not (isinstance(obj, type) and issubclass(obj, Testbed)):
        return f"{describe(obj)} is not a Testbed subclass (services/testbeds/base.py)"
    settings = getattr(obj, "Settings", None)
    if getattr(obj, "name", None) != name or not (isinstance(settings, type) and issubclass(settings, TestbedSettings)
                                                  and settings.model_fields["name"].default == name):
        return (f"{obj.__name__} must have `name = {name!r}` (the entry point's name) and a TestbedSettings subclass "
                f"as `Settings` with `name: Literal[{name!r}] = {name!r}`")
    if inspect.isabstract(obj):
        return f"{obj.__name__} leaves abstract methods unimplemented: {sorted(obj.__abstractmethods__)}"
    return None


TESTBEDS.update(load_plugins("steadyrl.testbeds", "testbed", TESTBEDS, _not_a_testbed))
TESTBED_SETTINGS: dict[str, type[TestbedSettings]] = {name: t.Settings for name, t in TESTBEDS.items()}
DEFAULT_TESTBED = "digits"
