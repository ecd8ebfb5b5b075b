"""Testbeds: what the services read instead of constants (docs/architecture.md, "What a new testbed implements").

A testbed joins its data half (rollout/: prompts, policy, sampler, pre-training) and its scoring half
(reward/: reward models, gold monitor or verifier, eval summary) by name, and owns its config section
(`testbed:` in a preset, `settings.TestbedSettings`) and its REST profile. The rollout workers, the learner,
the controller, `steadyrl eval` and the reward app all go through this object, so a new testbed is a new
module here (`base.Testbed` and its `Settings`) and one line in `registry.TESTBEDS`, not a fork of the loop.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from steadyrl.services.testbeds.arith.masked import ArithSettings, ArithTestbed
from steadyrl.services.testbeds.base import Testbed
from steadyrl.services.testbeds.digits.testbed import DigitsSettings, DigitsTestbed
from steadyrl.services.testbeds.registry import DEFAULT_TESTBED, TESTBED_SETTINGS, TESTBEDS
from steadyrl.services.testbeds.settings import TestbedSettings
from steadyrl.services.testbeds.text_to_image.testbed import TextToImageSettings, TextToImageTestbed

if TYPE_CHECKING:
    from steadyrl.services.config import TrainConfig


def build_testbed(cfg: "TrainConfig") -> Testbed:
    """The testbed object of a run's config (its `testbed.name`)."""
    return TESTBEDS[cfg.testbed.name](cfg)


__all__ = ["DEFAULT_TESTBED", "TESTBEDS", "TESTBED_SETTINGS", "ArithSettings", "ArithTestbed", "DigitsSettings",
           "DigitsTestbed", "Testbed", "TestbedSettings", "TextToImageSettings", "TextToImageTestbed",
           "build_testbed"]
