"""Config loading, overrides and the errors users see."""
from __future__ import annotations

import pytest
from typer.testing import CliRunner

from steadyrl.services.config import ConfigError, DEFAULT_CONFIG, load_config, parse_override
from steadyrl.services.driver.cli import app


def test_default_config_loads_and_overrides_apply():
    cfg = load_config()
    assert cfg.objective.name == "grpo" and cfg.run.steps > 0
    cfg = load_config(DEFAULT_CONFIG, ["learner.lr=3e-5", "run.steps=7", "testbed.reward.train_on=mean",
                                       "testbed.model.block_out_channels=[16,32]"])
    assert cfg.learner.lr == 3e-5 and cfg.run.steps == 7 and cfg.testbed.reward.train_on == "mean"
    assert cfg.testbed.model.block_out_channels == (16, 32)


@pytest.mark.parametrize("override, field", [
    ("learner.lrr=1", "learner.lrr"),
    ("learner.lr=-1", "learner.lr"),
    ("learner.lr=fast", "learner.lr"),
    ("objective.eps_clip=2", "objective.eps_clip"),
    ("sampler.logp_reduce=median", "sampler.logp_reduce"),
    ("nosuchsection.x=1", "nosuchsection"),
    ("serve.replica_cpus=1", "serve.replica_cpus"),
    ("testbed.reward.train_on=gold", "reward"),
])
def test_bad_key_or_value_names_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT_CONFIG, [override])
    assert field in str(err.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="key.sub=value"):
        parse_override("learner.lr")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("learner..lr=1")
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])


def test_missing_config_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_cli_bad_override_exits_2_with_the_field_named():
    result = CliRunner().invoke(app, ["train", "learner.zero_stage=7"])
    assert result.exit_code == 2
    assert "learner.zero_stage" in result.output


def test_cli_eval_rejects_a_folder_that_is_not_a_run(tmp_path):
    result = CliRunner().invoke(app, ["eval", str(tmp_path)])
    assert result.exit_code == 2 and "not a run folder" in result.output


@pytest.mark.parametrize("preset", ["arith-grpo", "arith-stabledrl", "arith-stabledrl-code", "arith-bgpo",
                                    "arith-sudoku-grpo"])
def test_arith_presets_load_with_their_objective_and_the_masked_diffusion_sampler(preset):
    from steadyrl.services.config import CONFIG_DIR

    cfg = load_config(CONFIG_DIR / f"{preset}.yaml")
    assert cfg.testbed.name == "arith" and cfg.sampler.kind == "masked_diffusion"
    assert cfg.objective.name == {"arith-grpo": "grpo", "arith-stabledrl": "stabledrl.paper",
                                  "arith-stabledrl-code": "stabledrl.code", "arith-bgpo": "bgpo.paper",
                                  "arith-sudoku-grpo": "grpo"}[preset]


@pytest.mark.parametrize("overrides, field", [
    (["testbed.name=arith"], "sampler.kind=masked_diffusion"),
    (["sampler.kind=masked_diffusion"], "testbed 'digits'"),
    (["testbed.name=arith", "sampler.kind=masked_diffusion", "ray.rollout_workers=20"], "ray.rollout_workers"),
    (["testbed.name=arith", "sampler.kind=masked_diffusion", "sampler.gen_length=6", "sampler.block_length=4"],
     "block_length"),
    (["testbed.name=arith", "sampler.kind=masked_diffusion", "sampler.estimator=exact"], "sampler.estimator"),
    (["testbed.name=arith", "sampler.kind=masked_diffusion", "testbed.task=chess"], "testbed.task"),
])
def test_a_testbed_and_sampler_that_do_not_fit_are_refused_by_name(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config(DEFAULT_CONFIG, overrides)
    assert field in str(err.value)


def test_lr_and_kl_schedules_span_the_run_unless_told_otherwise_and_a_warmup_must_end_before_it():
    from steadyrl.services.config import CONFIG_DIR, load_config

    cfg = load_config(CONFIG_DIR / "smoke.yaml", ["learner.lr_schedule.kind=cosine", "run.steps=12"])
    assert cfg.learner.lr_schedule.total_updates == 12
    fixed = load_config(CONFIG_DIR / "smoke.yaml", ["learner.lr_schedule.kind=cosine",
                                                    "learner.lr_schedule.total_updates=5"])
    assert fixed.learner.lr_schedule.total_updates == 5
    kl = load_config(CONFIG_DIR / "smoke.yaml", ["learner.kl_schedule.kind=linear", "run.steps=7"])
    assert kl.learner.kl_schedule.total_updates == 7
    with pytest.raises(ValueError, match=r"learner.lr_schedule.warmup_updates=12 must be less than run.steps=12"):
        load_config(CONFIG_DIR / "smoke.yaml", ["learner.lr_schedule.kind=cosine", "run.steps=12",
                                                "learner.lr_schedule.warmup_updates=12"])
