"""Testbeds: what the services read instead of constants (docs/architecture.md, "What a new testbed implements").

A testbed joins its data half (rollout/: prompts, policy, sampler, pre-training) and its scoring half
(reward/: reward models, gold monitor or verifier, eval summary) by name. The rollout workers, the
learner, the controller, `steadyrl eval` and the reward app all go through this object, so a new
testbed is a new module here (`base.Testbed`), not a fork of the loop.
"""
from __future__ import annotations

from steadyrl.services.config import TrainConfig
from steadyrl.services.testbeds.arith import ArithTestbed
from steadyrl.services.testbeds.base import Testbed
from steadyrl.services.testbeds.digits import DigitsTestbed
from steadyrl.services.testbeds.text_to_image import TextToImageTestbed

TESTBEDS: dict[str, type[Testbed]] = {"digits": DigitsTestbed, "arith": ArithTestbed,
                                      "text_to_image": TextToImageTestbed}


def build_testbed(cfg: TrainConfig) -> Testbed:
    return TESTBEDS[cfg.testbed](cfg)


__all__ = ["TESTBEDS", "ArithTestbed", "DigitsTestbed", "Testbed", "TextToImageTestbed", "build_testbed"]
