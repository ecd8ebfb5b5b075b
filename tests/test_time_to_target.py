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


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The smoke preset for 6 steps evaluated every 2 (one process, no Ray), then again with its best held-out
    after the base as the target."""
    root = tmp_path_factory.mktemp("ttt")
    full, _ = train_local(CONFIG_DIR / "smoke.yaml", root / "full", SMOKE)
    evals = json.loads((full.run_dir / "evals.json").read_text())
    target = max(e["held_out"] for e in evals[1:])
    targeted, _ = train_local(CONFIG_DIR / "smoke.yaml", root / "targeted", [*SMOKE, f"run.target_held_out={target}"])
    return {"full": full.run_dir, "targeted": targeted.run_dir, "target": target}


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
    again, rows = train_local(CONFIG_DIR / "smoke.yaml", runs["targeted"],
                              [*SMOKE, f"run.target_held_out={runs['target']}", "run.resume=auto"])
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
