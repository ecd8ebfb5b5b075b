"""What a process imports before it does any work: the CLI, the driver, a Serve reward replica and the rollout
worker's and learner's modules load no model library until they build a model (diffusers' UNet module alone loads
all of diffusers' transformers; every actor and replica of a Ray job pays its imports at start-up)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("diffusers", "deepspeed", "transformers", "peft", "torch._dynamo")


@pytest.mark.parametrize("module", [
    "steadyrl.services.driver.cli",  # `steadyrl --help`
    "steadyrl.services.driver.controller",  # the driver of `steadyrl train`
    "steadyrl.services.serving.deployments",  # a Serve reward replica
    "steadyrl.services.runtime.actors",  # a rollout worker, before it builds its policy
    "steadyrl.services.runtime.learner_group",  # a learner rank, before it builds its engine
])
def test_a_process_entry_module_imports_no_model_library(module):
    code = f"import sys, json, {module}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_the_digits_policy_still_builds_its_unet_on_demand():
    code = ("import sys; from steadyrl.rollout.config import UNetConfig;"
            " from steadyrl.rollout.models import build_unet;"
            " assert 'diffusers.models.unets.unet_2d' not in sys.modules; m = build_unet(UNetConfig());"
            " print(type(m).__name__, sum(p.numel() for p in m.parameters()) > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["UNet2DModel", "True"]
