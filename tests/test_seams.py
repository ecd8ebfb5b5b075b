"""The seams the objectives and samplers plug into: batch extras, config-time validation, the sampler factory."""
from __future__ import annotations

import pytest
import torch

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import DDIMSamplerConfig, SchedulerConfig
from steadyrl.rollout.sampler_factory import build_sampler
from steadyrl.services.config import ConfigError, load_config


def make_batch(n: int, **extras: torch.Tensor) -> RolloutBatch:
    return RolloutBatch(cond=torch.arange(n), group=torch.arange(n) // 2, samples=torch.randn(n, 1, 8, 8),
                        traj=torch.randn(n, 3, 1, 8, 8), old_logp=torch.randn(n, 2), timesteps=torch.tensor([5, 0]),
                        trainable=torch.tensor([True, False]), extras=extras)


def test_extras_follow_every_sample_through_index_split_concat_and_to():
    n = 7
    batch = make_batch(n, gate=torch.arange(n) % 2 == 0, weight=torch.arange(n, dtype=torch.float32),
                       mask=torch.arange(n * 3).view(n, 3))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    shuffled = batch.index(perm)
    for name in ("gate", "weight", "mask"):
        assert torch.equal(shuffled.extras[name], batch.extras[name][perm])
    parts = shuffled.split(3)
    assert [len(p.extras["weight"]) for p in parts] == [3, 3, 1]
    joined = RolloutBatch.concat(parts)
    assert all(torch.equal(joined.extras[k], shuffled.extras[k]) for k in batch.extras)
    # every extra stays attached to its own sample: cond and weight were built equal
    assert torch.equal(joined.extras["weight"].long(), joined.cond)
    moved = joined.to(torch.float64)
    assert moved.extras["weight"].dtype == torch.float64 and moved.extras["mask"].dtype == torch.long
    assert moved.extras["gate"].dtype == torch.bool
    assert set(batch.with_extras(extra=torch.zeros(n)).extras) == {"gate", "weight", "mask", "extra"}


def test_extras_must_be_per_sample_and_agree_across_joined_batches():
    with pytest.raises(ValueError, match=r"extras\['w'\].*first dimension 4"):
        make_batch(4, w=torch.zeros(3))
    with pytest.raises(ValueError, match="extras"):
        RolloutBatch.concat([make_batch(2, a=torch.zeros(2)), make_batch(2, b=torch.zeros(2))])


@pytest.mark.parametrize("overrides, named", [
    (["objective.name=nope"], "objective"),
    (["objective.name=grpo", "objective.nope=1"], "objective.nope"),
    (["objective.eps_clip=2"], "objective.eps_clip"),
    (["sampler.kind=euler"], "sampler"),
    (["sampler.kind=flow_sde", "sampler.eta=0.5"], "sampler.eta"),
    (["learner.optim_batch_size=48"], "learner"),
])
def test_bad_objective_or_sampler_settings_fail_at_config_load_naming_the_field(overrides, named):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert named in str(err.value)
    if overrides == ["objective.name=nope"]:
        assert "'grpo'" in str(err.value)  # the choices are listed


def test_sections_without_a_kind_or_name_default_to_ddim_and_grpo():
    cfg = load_config(None, [])
    assert cfg.sampler.kind == "ddim" and cfg.objective.name == "grpo"
    assert cfg.objective.train_min_std == 0.05  # the preset's per-objective settings reach the objective


def test_sampler_factory_builds_by_kind_with_a_consistent_schedule():
    sampler = build_sampler(DDIMSamplerConfig(num_steps=5), SchedulerConfig())
    T = len(sampler.timesteps)
    assert T == 5 and sampler.std.shape == sampler.dt.shape == sampler.trainable.shape == (T,)
    assert bool((sampler.dt > 0).all()) and float(sampler.dt.sum()) <= 1.0 + 1e-9
    assert torch.equal(sampler.train_steps(0.0), sampler.trainable_steps)
    with pytest.raises(ValueError, match="train_min_std"):
        sampler.train_steps(10.0)


def test_a_config_built_from_defaults_alone_validates_and_round_trips():
    from steadyrl.services.config import TrainConfig

    cfg = TrainConfig()
    assert cfg.sampler.kind == "ddim" and cfg.objective.name == "grpo"
    assert TrainConfig.model_validate(cfg.model_dump(mode="json")) == cfg  # what a worker receives


def test_preset_base_merges_sections_and_a_switched_objective_starts_afresh(tmp_path):
    (tmp_path / "base.yaml").write_text("run: {steps: 7, name: b}\nobjective: {name: grpo, eps_clip: 0.3}\n")
    (tmp_path / "child.yaml").write_text("base: base.yaml\nrun: {name: c}\nobjective: {name: draft}\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert cfg.run.steps == 7 and cfg.run.name == "c"  # merged key by key
    assert cfg.objective.name == "draft"  # grpo's eps_clip did not leak into an objective without one
    cfg = load_config(tmp_path / "base.yaml", ["objective.kl_coef=0.5", "objective.name=gardo.paper"])
    assert cfg.objective.name == "gardo.paper" and cfg.objective.kl_coef == 0.5  # switch first, then the rest
    (tmp_path / "loop.yaml").write_text("base: loop.yaml\n")
    with pytest.raises(ConfigError, match="includes itself"):
        load_config(tmp_path / "loop.yaml")


@pytest.mark.parametrize("preset", sorted(p.name for p in __import__("steadyrl.services.config", fromlist=["CONFIG_DIR"])
                                          .CONFIG_DIR.glob("digits-*.yaml")))
def test_every_digits_preset_loads_and_names_its_run_after_itself(preset):
    from steadyrl.services.config import CONFIG_DIR

    cfg = load_config(CONFIG_DIR / preset)
    assert cfg.run.name == preset.removesuffix(".yaml")
