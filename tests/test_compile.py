"""`compile.rollout` / `compile.update`: torch.compile of the model passes, in place. A compiled run of the product
loop (local runtime) against the same run eager: the same numbers to rounding (tolerances below), the recompute
alarm silent, the compile time reported apart and spent once; and the setting refused where it cannot apply."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from steadyrl.rollout.compile import CompileConfig, compile_network, is_compiled
from steadyrl.rollout.policy import make_reference
from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
from tests.helpers import train_local

RUN = ["run.steps=3", "run.eval_every=3", "run.checkpoint_every=3", "sampler.group_size=4",
       "testbed.eval_samples_per_class=4"]
# Compiled kernels fuse and reorder float operations: a compiled pass equals the eager one to these tolerances,
# not bitwise, and the runs stay that close over their updates (benchmarks/compile_update.py: the same training
# reward to 4 decimals over 6 default steps). With inductor's CPU layout optimisation on, step 2 already differed
# by 0.013 (wrong gradients).
REWARD_TOL = 1e-5  # |compiled - eager| of the mean training reward of step 1's rollouts (the base weights)
RUN_REWARD_TOL = 1e-3  # ... of every later step's, after updates computed compiled and eager
OUTPUT_TOL = 1e-5  # max |compiled - eager| / max |eager| of the network's output (the same weights, inputs)
GRAD_TOL = 1e-4  # ... of each parameter's gradient


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The smoke preset for 3 steps, eager and with both passes compiled (one process each, no Ray)."""
    root = tmp_path_factory.mktemp("compile")
    out = {}
    for name, extra in (("eager", []), ("compiled", ["compile.rollout=true", "compile.update=true"])):
        result, rows = train_local(CONFIG_DIR / "smoke.yaml", root / name, [*RUN, *extra])
        out[name] = {"dir": result.run_dir, "rows": rows,
                     "evals": json.loads((result.run_dir / "evals.json").read_text())}
    return out


def test_a_compiled_run_samples_and_learns_as_the_eager_run_to_rounding(runs):
    eager, compiled = runs["eager"]["rows"], runs["compiled"]["rows"]
    assert abs(eager[0]["reward/train_mean"] - compiled[0]["reward/train_mean"]) <= REWARD_TOL
    for a, b in zip(eager[1:], compiled[1:]):
        assert abs(a["reward/train_mean"] - b["reward/train_mean"]) <= RUN_REWARD_TOL, (a["step"], a, b)


def test_the_recompute_alarm_stays_silent_when_rollout_and_update_are_compiled(runs):
    rows = runs["compiled"]["rows"]
    assert all(r["policy/rollout_logp_alarm"] == 0.0 for r in rows)
    assert max(r["policy/rollout_logp_absdiff_max"] for r in rows) <= 1e-3  # learner.logp_alarm


def test_compile_time_is_reported_apart_and_spent_on_the_first_step_only(runs):
    """The update's graphs compile in step 1; the rollout's in the base evaluation (its batch shape) and step 1 (a
    step's shape, when it differs): nothing compiles after, and an eager run reports no compile time."""
    rows, evals = runs["compiled"]["rows"], runs["compiled"]["evals"]
    assert 0 < rows[0]["timing_s/update_compile"] <= rows[0]["timing_s/update"]
    assert evals[0]["rollout_compile_s"] + rows[0]["timing_s/rollout_compile"] > 0
    assert all(r["timing_s/update_compile"] == 0.0 and r["timing_s/rollout_compile"] == 0.0 for r in rows[1:])
    assert all(e["rollout_compile_s"] == 0.0 for e in evals[1:])
    assert "timing_s/update_compile" not in runs["eager"]["rows"][0]
    assert "rollout_compile_s" not in runs["eager"]["evals"][0]


def test_a_compiled_network_is_the_same_module_and_computes_the_eager_pass_to_rounding():
    """In place: the same module, parameters and state-dict keys; a reference copied before stays eager; the
    forward and backward on the same weights and inputs match an eager copy's within OUTPUT_TOL / GRAD_TOL."""
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(CONFIG_DIR / "smoke.yaml")
    testbed = build_testbed(cfg)
    policy = testbed.build_policy(load_file(str(testbed.base_weights(progress=False)))).train()
    keys, params = list(policy.state_dict()), [id(p) for p in policy.parameters()]
    reference = make_reference(policy)
    eager = copy.deepcopy(policy)
    assert compile_network(policy, CompileConfig(update=True)) is policy and is_compiled(policy)
    assert list(policy.state_dict()) == keys and [id(p) for p in policy.parameters()] == params
    assert not is_compiled(reference) and not is_compiled(eager)
    gen = torch.Generator().manual_seed(0)
    x, t, cond = torch.randn(8, 1, 8, 8, generator=gen), torch.full((8,), 500), torch.arange(8) % 10
    outputs = []
    for net in (eager, policy):
        out = net(x, t, cond)
        out.square().mean().backward()
        outputs.append((out.detach(), {n: p.grad for n, p in net.named_parameters()}))
    (want, want_grads), (got, got_grads) = outputs
    assert float((got - want).abs().max()) <= OUTPUT_TOL * float(want.abs().max())
    scale = max(float(g.abs().max()) for g in want_grads.values())  # a gradient that is 0 in exact arithmetic
    for name, grad in want_grads.items():  # (attention key biases) is rounding on both sides: judged on this scale
        assert float((got_grads[name] - grad).abs().max()) <= GRAD_TOL * max(float(grad.abs().max()), scale * 1e-3), \
            name


def test_compiling_the_rollout_of_a_vllm_engine_is_refused_naming_the_fields():
    with pytest.raises(ConfigError, match="compile.rollout.*sampler.backend=vllm"):
        load_config(CONFIG_DIR / "arith-ar-vllm-grpo.yaml", ["compile.rollout=true"])
    assert load_config(CONFIG_DIR / "arith-ar-vllm-grpo.yaml", ["compile.update=true"]).compile.update


@pytest.mark.parametrize("overrides, trained", [
    ([], 4),  # the default job: a window of the 4 noisiest steps, all trained
    (["sampler.sde_window=null"], 8),  # every step with std >= 0.05 (8 of 10), all trained
    (["objective.timestep_fraction=0.5"], 2),  # half the window
])
def test_the_flop_benchmark_counts_the_steps_the_learner_trains_within_the_window(overrides, trained):
    from benchmarks.compile_update import trained_steps_per_sample
    from steadyrl.services.config import DEFAULT_CONFIG, load_config
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(DEFAULT_CONFIG, overrides)
    assert trained_steps_per_sample(cfg, build_testbed(cfg).build_sampler()) == trained
