"""The update path an objective takes on a sampler (trainer/update_path.py): the table each method's definition
gives, checked for every registered objective on every sampler kind, and refused by the config before anything
starts with the same message the learner would give."""
from __future__ import annotations

import pytest

from steadyrl.rollout.config import (AutoregressiveSamplerConfig, BlockDiffusionSamplerConfig, DDIMSamplerConfig,
                                     FlowSDESamplerConfig, MaskedDiffusionSamplerConfig)
from steadyrl.services.config import ConfigError, load_config
from steadyrl.trainer.objectives import available, objective_class, settings_types
from steadyrl.trainer.update_path import update_path

SAMPLERS = {"ddim": DDIMSamplerConfig(), "flow_sde": FlowSDESamplerConfig(),
            "masked_diffusion": MaskedDiffusionSamplerConfig(), "autoregressive": AutoregressiveSamplerConfig(),
            "block_diffusion": BlockDiffusionSamplerConfig()}
IMAGES, LMS = ("ddim", "flow_sde"), ("masked_diffusion", "autoregressive", "block_diffusion")


def expected(name: str, kind: str) -> str | None:
    """What each method is, written from its definition (None: it cannot run on that sampler)."""
    if name in ("diffusion_nft.code", "diffusion_nft.paper", "gardo.nft"):  # velocities at re-noised clean samples
        return "forward_process" if kind == "flow_sde" else None
    if name in ("draft", "grpo_guard.seed"):  # re-run the last Gaussian steps with the reward's gradient
        return "reward_backprop" if kind in IMAGES else None
    if name == "grpo_guard.paper":  # ratios normalised by the Gaussian step means
        return "per_step" if kind in IMAGES else None
    if name == "grpo.d1":  # per-token ratios of a language model
        return "per_step" if kind in LMS else None
    if name == "bgpo.paper":  # each term (step or MC sample) its own bound
        return "per_step"
    return "per_step" if kind in IMAGES else "sequence"  # GRPO, GARDO, StableDRL: one ratio per sequence on LMs


def test_every_registered_objective_is_in_the_table():
    assert set(available()) == {"bgpo.paper", "diffusion_nft.code", "diffusion_nft.paper", "draft", "gardo.nft",
                                "gardo.paper", "gardo.seed", "grpo", "grpo.d1", "grpo_guard.paper", "grpo_guard.seed",
                                "stabledrl.code", "stabledrl.paper"}


@pytest.mark.parametrize("name", available())
@pytest.mark.parametrize("kind", list(SAMPLERS))
def test_each_objective_takes_the_path_its_definition_gives_on_each_sampler(name, kind):
    want = expected(name, kind)
    if want is None:
        with pytest.raises(ValueError, match=rf"sampler\.kind={kind!r}|sampler\.kind='flow_sde'"):
            update_path(objective_class(name), settings_types()[name](), SAMPLERS[kind])
    else:
        assert update_path(objective_class(name), settings_types()[name](), SAMPLERS[kind]) == want


def test_per_token_ratios_refuse_masks_redrawn_at_the_completion_but_not_one_step_masks():
    d1 = objective_class("grpo.d1")
    with pytest.raises(ValueError, match="sampler.masks=shared"):
        update_path(d1, settings_types()["grpo.d1"](), MaskedDiffusionSamplerConfig(masks="independent"))
    with pytest.raises(ValueError, match="sampler.masks=shared"):
        update_path(d1, settings_types()["grpo.d1"](), BlockDiffusionSamplerConfig(masks="independent"))
    assert update_path(d1, settings_types()["grpo.d1"](),
                       MaskedDiffusionSamplerConfig(masks="independent", estimator="one_step")) == "per_step"


def test_reward_backprop_steps_are_bounded_by_the_samplers_steps():
    draft = objective_class("draft")
    ok = settings_types()["draft"](backprop_steps=5)
    assert update_path(draft, ok, DDIMSamplerConfig(num_steps=5)) == "reward_backprop"
    with pytest.raises(ValueError, match=r"objective.backprop_steps=5 must be in \[1, 4\]"):
        update_path(draft, ok, DDIMSamplerConfig(num_steps=4))


@pytest.mark.parametrize("overrides,needle", [
    (["objective.name=diffusion_nft.code"], "needs sampler.kind='flow_sde', not sampler.kind='ddim'"),
    (["objective.name=grpo.d1"], "per-token ratios of a masked-diffusion LM"),
])
def test_the_config_refuses_a_path_that_cannot_run_before_anything_starts(overrides, needle):
    """The digits testbed samples with DDIM: the learner's own check, run when the config is read."""
    with pytest.raises(ConfigError, match=needle):
        load_config(None, overrides)
