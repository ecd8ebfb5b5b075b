"""Time to a held-out target: read back from hand-made run folders against sums done by hand, `run.target_held_out`
ending a real run (the product loop, local runtime) at the evaluation where the same run without it first
reached that level, and `steadyrl inspect` / `steadyrl compare --target` showing it."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from steadyrl.services.config import CONFIG_DIR
from steadyrl.services.driver.cli import app
from steadyrl.services.run_folder.reader import load_run
from steadyrl.services.run_folder.time_to_target import held_out_curve, time_to_target
from tests.helpers import train_local

SMOKE = ["run.steps=6", "run.eval_every=2", "run.checkpoint_every=6", "sampler.group_size=4",
         "testbed.eval_samples_per_class=4"]


def hand_made_run(path: Path, step_s: list[float], evals: dict[int, float], steps: list[int] | None = None) -> Path:
    """A run folder with one metrics row per entry of `steps` (default 1..n) taking `step_s` seconds and drawing
    8 samples each, and evaluations {step: held-out}."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("run:\n  name: hand-made\n")
    steps = steps or list(range(1, len(step_s) + 1))
    (path / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "timing_s/step": t, "rollout/samples": 8.0}) + "\n" for s, t in zip(steps, step_s)))
    (path / "evals.json").write_text(json.dumps([{"step": s, "held_out": h, "proxy_mean": h, "diversity_nn": 1.0}
                                                 for s, h in evals.items()]))
    return path


def test_the_crossing_is_the_first_evaluation_at_or_above_the_target_and_its_time_the_steps_before_it(tmp_path):
    run = load_run(hand_made_run(tmp_path / "r", [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], {0: 0.6, 2: 0.8, 4: 0.95, 6: 0.97}))
    t = time_to_target(run, 0.95)
    assert (t.reached, t.step, t.train_s, t.samples) == (True, 4, 1.0 + 2.0 + 3.0 + 4.0, 32)
    assert (t.best, t.best_step, t.evals) == (0.97, 6, 4)
    assert time_to_target(run, 0.8).step == 2 and time_to_target(run, 0.5).step == 0  # at or above; the base counts
    assert time_to_target(run, 0.5).train_s == 0.0
    missed = time_to_target(run, 0.99)
    assert (missed.reached, missed.step, missed.train_s) == (False, None, None) and "best 97.0% at step 6" in missed.text()
    assert held_out_curve(run) == [(0.0, 0.6), (3.0, 0.8), (10.0, 0.95), (21.0, 0.97)]


def test_steps_redone_after_a_rollback_count_again_toward_the_time(tmp_path):
    """Steps 1-4, rolled back to step 2, steps 3-4 again: the kept evaluation at 4 follows the second pass."""
    run = load_run(hand_made_run(tmp_path / "r", [1.0, 1.0, 1.0, 1.0, 2.0, 2.0], {0: 0.5, 2: 0.7, 4: 0.9},
                                 steps=[1, 2, 3, 4, 3, 4]))
    t = time_to_target(run, 0.9)
    assert (t.step, t.train_s, t.samples) == (4, 8.0, 48)
    assert held_out_curve(run)[-1] == (8.0, 0.9)


def test_no_evaluation_has_no_best_and_is_not_reached(tmp_path):
    t = time_to_target(load_run(hand_made_run(tmp_path / "r", [1.0], {})), 0.9)
    assert not t.reached and t.best_step is None and math.isnan(t.best) and "no evaluation" in t.text()


PRESETS = {"digits": ("smoke.yaml", SMOKE),  # held-out: gold accuracy; arith: greedy exact match
           "arith": ("arith-grpo.yaml", ["run.steps=4", "run.eval_every=2", "run.checkpoint_every=4",
                                         "testbed.eval_problems=100"])}


@pytest.fixture(scope="module", params=sorted(PRESETS))
def runs(request, tmp_path_factory) -> dict:
    """A preset for a few steps evaluated every 2 (one process, no Ray), then again with its best held-out after
    the base as the target: the digits smoke preset (gold accuracy) and arith (exact match)."""
    config, overrides = PRESETS[request.param]
    root = tmp_path_factory.mktemp(f"ttt-{request.param}")
    full, _ = train_local(CONFIG_DIR / config, root / "full", overrides)
    evals = json.loads((full.run_dir / "evals.json").read_text())
    target = max(e["held_out"] for e in evals[1:])
    targeted, _ = train_local(CONFIG_DIR / config, root / "targeted", [*overrides, f"run.target_held_out={target}"])
    return {"full": full.run_dir, "targeted": targeted.run_dir, "target": target, "config": config,
            "overrides": overrides}


def test_a_run_with_a_target_ends_at_the_evaluation_where_the_same_run_first_reached_it(runs):
    full, targeted = load_run(runs["full"]), load_run(runs["targeted"])
    crossing = next(e["step"] for e in full.evals if e["held_out"] >= runs["target"])
    assert [e["step"] for e in targeted.evals] == [e["step"] for e in full.evals if e["step"] <= crossing]
    assert [e["held_out"] for e in targeted.evals] == [e["held_out"] for e in full.evals[: len(targeted.evals)]]
    assert len(targeted.metrics) == crossing  # no step past the crossing
    if crossing > 0:
        assert (runs["targeted"] / "checkpoints" / f"step_{crossing}").is_dir()  # it ends checkpointed
    assert time_to_target(targeted, runs["target"]).step == crossing == time_to_target(full, runs["target"]).step


def test_the_same_command_run_again_on_a_run_that_reached_its_target_adds_no_step(runs):
    before = (runs["targeted"] / "metrics.jsonl").read_text()
    again, rows = train_local(CONFIG_DIR / runs["config"], runs["targeted"],
                              [*runs["overrides"], f"run.target_held_out={runs['target']}", "run.resume=auto"])
    assert (runs["targeted"] / "metrics.jsonl").read_text() == before
    assert again.steps_done == len(rows)


def test_inspect_and_compare_show_the_time_to_a_target_given(runs, tmp_path):
    target = runs["target"]
    t = time_to_target(load_run(runs["full"]), target)
    shown = CliRunner().invoke(app, ["inspect", str(runs["full"]), "--out", str(tmp_path / "i"), "--target",
                                     str(target)], terminal_width=200)
    assert shown.exit_code == 0, shown.output
    row = next(line for line in shown.output.splitlines() if line.startswith("│ full"))
    assert [c.strip() for c in row.strip("│").split("│")][:4] == ["full", str(t.step), f"{t.train_s:.4g}",
                                                                 f"{t.samples:.4g}"]
    compared = CliRunner().invoke(app, ["compare", str(runs["full"]), str(runs["targeted"]), "--out",
                                        str(tmp_path / "c"), "--target", str(target)], terminal_width=200)
    assert compared.exit_code == 0, compared.output
    assert f"time to {target:.1%} held-out" in compared.output
    assert (tmp_path / "c" / "held_out_vs_time.png").stat().st_size > 10_000
    plain = CliRunner().invoke(app, ["inspect", str(runs["full"]), "--out", str(tmp_path / "p")], terminal_width=200)
    assert "time to" not in plain.output  # only when asked


def summary(held_out: list[float], diversity: list[float], hacking: int = 0, reached: int = 3) -> dict:
    from benchmarks.figures import spread

    return {"seeds": 3, "reached": reached, "hacking_flagged": hacking, "train_s": spread([10.0, 12.0, 14.0]),
            "final_held_out": spread(held_out), "final_diversity_nn": spread(diversity)}


def test_the_sweep_keeps_a_setting_only_if_its_median_end_is_no_worse_than_the_baselines_lowest_seed():
    from benchmarks.time_to_target import keep_verdict

    base = summary([0.97, 0.99, 0.995], [6.0, 6.4, 6.5])
    at_the_edge = keep_verdict(summary([0.96, 0.97, 1.0], [5.0, 6.0, 9.0]), base)
    assert at_the_edge == {"kept": True, "reasons": [], "speedup_train_s": 1.0}
    below = keep_verdict(summary([0.96, 0.969, 1.0], [5.0, 5.99, 9.0]), base)
    assert not below["kept"] and [r.split()[0] for r in below["reasons"]] == ["final_held_out",
                                                                                "final_diversity_nn"]
    hacked = keep_verdict(summary([0.99] * 3, [7.0] * 3, hacking=1, reached=2), base)
    assert not hacked["kept"] and len(hacked["reasons"]) == 2


def test_an_earlier_sweeps_arm_is_reused_only_when_it_ran_the_same_config_overrides_seeds_and_settings(tmp_path):
    from benchmarks.time_to_target import reusable_arm

    setup = {"seeds": [0, 1, 2], "target": 0.95, "eval_every": 2, "steps": None, "until": "budget",
             "runtime": "local"}
    arm = {"config": "configs/digits-grpo.yaml", "overrides": ["learner.lr=2e-4"], "runs": [{"seed": 0}],
           "summary": {}, "against_baseline": {"kept": True}}
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"seeds": [0, 1, 2], "target_held_out": 0.95, "eval_every": 2, "until": "budget",
                                   "runtime": "local", "arms": {"lr": arm}}))
    got = reusable_arm([earlier], "lr", arm["config"], arm["overrides"], setup)
    assert got == {"config": arm["config"], "overrides": arm["overrides"], "runs": arm["runs"], "summary": {},
                   "reused_from": str(earlier)}  # judged again against this sweep's baseline, not carried over
    assert reusable_arm([earlier], "lr", arm["config"], ["learner.lr=3e-4"], setup) is None
    assert reusable_arm([earlier], "lr", arm["config"], arm["overrides"], {**setup, "seeds": [0, 1]}) is None
    assert reusable_arm([earlier], "lr", arm["config"], arm["overrides"], {**setup, "eval_every": 5}) is None
    assert reusable_arm([earlier], "other", arm["config"], arm["overrides"], setup) is None
