"""The testbeds by name: a new testbed is its own module(s) and one line here."""
from __future__ import annotations

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
TESTBED_SETTINGS: dict[str, type[TestbedSettings]] = {name: t.Settings for name, t in TESTBEDS.items()}
DEFAULT_TESTBED = "digits"
