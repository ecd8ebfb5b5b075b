"""Testbeds own their config section: a run's config holds its testbed's settings only, and each testbed answers
for its samplers, its worker limit, its REST profile and whether reward back-propagation can train on it."""
from __future__ import annotations

import pytest
import yaml

from steadyrl.services.config import CONFIG_DIR, ConfigError, TrainConfig, dump_config, load_config
from steadyrl.services.testbeds import TESTBEDS, build_testbed

T2I = ["testbed.pretrained=some/pipeline"]  # never loaded: the config alone is checked
SECTIONS = {"compile", "testbed", "run", "sampler", "objective", "learner", "serve", "ray", "health"}


@pytest.mark.parametrize("preset", ["digits-grpo", "digits-flow-grpo", "arith-grpo", "arith-sudoku-grpo",
                                    "sd15-grpo", "sd35-gardo", "flux-grpo"])
def test_a_saved_config_holds_its_testbeds_settings_and_nothing_of_another(preset):
    cfg = load_config(CONFIG_DIR / f"{preset}.yaml")
    saved = yaml.safe_load(dump_config(cfg))
    assert set(saved) == SECTIONS
    own = set(TESTBEDS[cfg.testbed.name].Settings.model_fields)
    assert set(saved["testbed"]) == own and saved["testbed"]["name"] == cfg.testbed.name
    for other, testbed in TESTBEDS.items():
        if other != cfg.testbed.name:  # e.g. an SD 1.5 run carries no digits UNet, classifiers or arith task
            assert not (set(testbed.Settings.model_fields) - own - {"name"}) & set(saved["testbed"])
    assert load_config_from_text(dump_config(cfg)) == cfg  # what a resume reads back


def load_config_from_text(text: str) -> TrainConfig:
    return TrainConfig.model_validate(yaml.safe_load(text))


@pytest.mark.parametrize("preset, overrides", [("sd15-grpo", []), ("arith-grpo", []),
                                               ("digits-grpo", ["testbed.name=text_to_image", *T2I])])
def test_reward_backprop_objectives_are_refused_where_the_reward_has_no_gradient(preset, overrides):
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG_DIR / f"{preset}.yaml", ["objective.name=draft", *overrides])
    text = str(err.value)
    assert "objective.name='draft'" in text and "testbed" in text and "policy-gradient objective" in text


def test_digits_gives_draft_its_classifiers_as_the_differentiable_reward():
    import torch

    cfg = load_config(CONFIG_DIR / "digits-draft.yaml")
    reward = cfg.testbed.differentiable_reward()
    x = torch.zeros(4, 1, 8, 8, requires_grad=True)
    out = reward(x, torch.tensor([0, 1, 2, 3]))
    out.sum().backward()
    assert out.shape == (4,) and ((0 <= out) & (out <= 1)).all() and x.grad.abs().sum() > 0


@pytest.mark.parametrize("overrides, limit", [
    (["ray.rollout_workers=11"], 10),  # digits: one class per worker at most
    (["testbed.name=arith", "sampler.kind=masked_diffusion", "testbed.prompts_per_step=4",
      "ray.rollout_workers=5"], 4),
    (["testbed.name=text_to_image", *T2I, "testbed.prompts.prompts_per_step=2", "ray.rollout_workers=3"], 2),
])
def test_each_testbed_caps_rollout_workers_at_what_it_can_split(overrides, limit):
    with pytest.raises(ConfigError, match=f"ray.rollout_workers=.* exceeds the {limit} prompts per step"):
        load_config(None, overrides)
    fewer = [o if not o.startswith("ray.rollout_workers") else f"ray.rollout_workers={limit}" for o in overrides]
    assert load_config(None, fewer).ray.rollout_workers == limit


def test_switching_the_testbed_starts_its_section_afresh():
    """The digits preset's pre-training (80 iterations) must not leak into arith's masked-LM pre-training."""
    digits = load_config(CONFIG_DIR / "digits-grpo.yaml")
    assert digits.testbed.name == "digits" and digits.testbed.pretrain.iterations == 80
    for switch in ("testbed.name=arith", "testbed=arith"):  # the shorthand means the same
        arith = load_config(CONFIG_DIR / "digits-grpo.yaml", [switch, "sampler.kind=masked_diffusion"])
        assert arith.testbed == type(arith.testbed)()
        assert build_testbed(arith).name == "arith"


def test_a_testbeds_section_names_its_bad_fields():
    with pytest.raises(ConfigError) as err:
        load_config(CONFIG_DIR / "arith-grpo.yaml", ["testbed.model.hidden=3", "testbed.digits=99"])
    text = str(err.value)
    assert "testbed.model.hidden (testbed 'arith')" in text and "testbed.digits (testbed 'arith')" in text
    with pytest.raises(ConfigError, match=r"testbed.pretrained \(testbed 'text_to_image'\): Field required"):
        load_config(None, ["testbed.name=text_to_image"])
    with pytest.raises(ConfigError, match="testbed 'arith' needs sampler.kind=masked_diffusion"):
        load_config(None, ["testbed.name=arith"])


def test_a_config_from_before_testbed_sections_is_told_where_its_sections_went(tmp_path):
    old = tmp_path / "config.yaml"
    old.write_text("testbed: arith\narith: {task: addition}\nsampler: {kind: masked_diffusion}\n"
                   "reward: {train_on: cnn}\n")
    with pytest.raises(ConfigError) as err:
        load_config(old)
    assert "arith: Extra inputs are not permitted (this section now lives in testbed (with name: arith))" in str(err.value)
    assert "reward: Extra inputs are not permitted (this section now lives in testbed.reward)" in str(err.value)


def test_every_testbed_supplies_its_rest_profile():
    for name, testbed in TESTBEDS.items():
        profile = testbed.rest
        assert profile.testbed == name and profile.request.model_fields["kind"].default == name
        assert profile.items == name.startswith("arith")  # verifiers score prompt/completion items, the rest tensors
