"""Collapse detection and rollback (`health.rollback`): the detector's rules, its defaults replayed on the stability
benchmark's measured runs, and a rollback through the product loop on the setting that collapses."""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

from steadyrl.services.run_folder.checkpoints import checkpoint_before, checkpoint_steps, latest_checkpoint
from steadyrl.trainer.collapse import CollapseDetector, RollbackConfig
from tests.helpers import train_local

ROOT = Path(__file__).resolve().parents[1]
STABILITY = ROOT / "benchmarks" / "results" / "stability" / "results.json"


def rows(*rewards: float, **extra: list[float]) -> list[dict[str, float]]:
    return [{"reward/train_mean": r, **{k.replace("__", "/"): v[i] for k, v in extra.items()}}
            for i, r in enumerate(rewards)]


def first_collapse(detector: CollapseDetector, series: list[dict[str, float]]):
    for step, row in enumerate(series, start=1):
        found = detector.observe(step, row)
        if found is not None:
            return found
    return None


def test_a_drop_below_the_best_window_mean_counts_only_after_patience_rows():
    cfg = RollbackConfig(enabled=True, patience=2, reward_drop=0.5, noise_sigmas=0.0)
    # window mean 0.8 -> limit 0.4; one bad row then a recovery is noise, two in a row a collapse
    assert first_collapse(CollapseDetector(cfg), rows(0.8, 0.8, 0.3, 0.8, 0.8)) is None
    found = first_collapse(CollapseDetector(cfg), rows(0.8, 0.8, 0.3, 0.35, 0.8))
    assert found is not None and found.step == 4
    assert found.bad_version == 2  # row 3 was sampled by the weights after 2 updates: the first to blame
    lagged = first_collapse(CollapseDetector(cfg, staleness=1), rows(0.8, 0.8, 0.3, 0.35))
    assert lagged.bad_version == 1  # one-step-off-policy: row 3 may have been sampled one version earlier


def test_the_noise_floor_keeps_a_noisy_reward_from_tripping_the_relative_rule():
    noisy = [0.1, 0.7, 0.1, 0.7, 0.1]
    best = max(statistics.fmean(noisy[:i]) for i in range(1, 6))  # 0.4
    s = statistics.pstdev(noisy)
    cfg = RollbackConfig(enabled=True, patience=2, reward_drop=0.5, noise_sigmas=1.0, window=5)
    assert best - 0.5 * best > 0.15 > best - s  # 0.15 is a 50 % drop, but within one std of the noise
    assert first_collapse(CollapseDetector(cfg), rows(*noisy, 0.15, 0.15)) is None
    assert first_collapse(CollapseDetector(cfg), rows(*noisy, 0.05, 0.05)) is not None


def test_the_baseline_is_the_best_level_reached_so_a_slow_slide_is_caught():
    cfg = RollbackConfig(enabled=True, patience=2, reward_drop=0.5, noise_sigmas=0.0, window=2)
    slide = [0.8, 0.8, 0.7, 0.6, 0.5, 0.45, 0.39, 0.38]  # each step within 50 % of the last two
    found = first_collapse(CollapseDetector(cfg), rows(*slide))
    assert found is not None and found.step == 8  # 0.39, 0.38 < 0.5 x 0.8


def test_a_nonfinite_value_is_a_collapse_at_once_and_explosions_need_patience():
    cfg = RollbackConfig(enabled=True, patience=2, grad_factor=10.0)
    found = first_collapse(CollapseDetector(cfg), rows(0.5, 0.5, math.nan))
    assert found is not None and found.step == 3
    spikes = rows(0.5, 0.5, 0.5, 0.5, 0.5, policy__grad_norm=[1.0, 1.2, 30.0, 1.1, 1.0])
    assert first_collapse(CollapseDetector(cfg), spikes) is None  # one spike, recovered
    spikes = rows(0.5, 0.5, 0.5, 0.5, policy__grad_norm=[1.0, 1.2, 30.0, 25.0])
    assert first_collapse(CollapseDetector(cfg), spikes).reasons[0].startswith("policy/grad_norm 30")
    ratio = rows(0.5, 0.5, 0.5, policy__ratio_mean=[1.0, 12.0, 0.05])
    assert first_collapse(CollapseDetector(cfg), ratio).step == 3


def test_rewinding_forgets_the_abandoned_rows_and_the_state_round_trips():
    cfg = RollbackConfig(enabled=True, window=3)
    det = CollapseDetector(cfg)
    for step, row in enumerate(rows(0.5, 0.6, 0.7, 0.1), start=1):
        det.observe(step, row)
    copy = CollapseDetector(cfg)
    copy.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert copy.state_dict() == det.state_dict()
    det.rewind(1)
    assert [h["step"] for h in det.healthy] == [1] and det.pending == []


def test_the_defaults_flag_the_stability_benchmarks_collapses_and_no_healthy_run():
    """Replays every run of benchmarks/results/stability (measured: 55 runs of 40 steps) through the detector with
    its defaults: the 11 StableDRL and d1 collapses are flagged, none of the 42 runs that ended well is."""
    runs = json.loads(STABILITY.read_text())["runs"]
    flagged, false_alarms, missed = [], [], []
    for run in runs:
        detector = CollapseDetector(RollbackConfig(enabled=True))
        series = [{"reward/train_mean": r["proxy"], **{k: r[k] for k in ("policy/grad_norm", "policy/ratio_mean",
                                                                           "policy/kl_ref_monitor")}}
                  for r in run["rows"]]
        found = first_collapse(detector, series)
        collapsed = run["evals"][-1]["held_out"] < run["evals"][0]["held_out"] - 0.15
        label = f"{run['method']} seed {run['seed']}"
        if found is not None:
            (flagged if collapsed else false_alarms).append(label)
        elif collapsed:
            missed.append(label)
    assert len(runs) == 55
    assert false_alarms == []
    assert len(flagged) == 11 and all(m.split(" ")[0] in ("c:stabledrl.paper", "c:stabledrl.code", "a:grpo.d1")
                                      for m in flagged)
    assert sorted(m.split(" ")[0] for m in missed) == ["c:bgpo.paper", "c:bgpo.paper"]


def test_checkpoint_before_picks_the_newest_whole_checkpoint_strictly_earlier(tmp_path):
    for step in (0, 5, 10):
        (tmp_path / "checkpoints" / f"step_{step}").mkdir(parents=True)
        (tmp_path / "checkpoints" / f"step_{step}" / "controller.json").write_text("{}")
    (tmp_path / "checkpoints" / ".step_15.tmp").mkdir()  # half-written: never a target
    (tmp_path / "checkpoints" / "step_12").mkdir()  # no controller state: not whole
    assert checkpoint_steps(tmp_path) == [0, 5, 10]
    assert checkpoint_before(tmp_path, 10).name == "step_5"
    assert checkpoint_before(tmp_path, 11).name == "step_10"
    assert checkpoint_before(tmp_path, 0) is None


@pytest.mark.timeout(600)
def test_a_collapsing_run_rolls_back_to_a_healthy_checkpoint_and_ends_above_its_base(tmp_path):
    """StableDRL with 16 optimiser steps per batch collapses the arith model within two updates (stability
    benchmark, setting (c): 3/3 seeds); with rollback the run restores step 0 at a lower learning rate and ends
    without a collapse."""
    run = tmp_path / "run"
    result, metrics = train_local(ROOT / "configs" / "arith-stabledrl.yaml", run, [
        "run.steps=12", "run.eval_every=12", "learner.inner_epochs=4", "learner.micro_batch_size=32",
        "learner.optim_batch_size=64", "health.rollback.enabled=true"])
    records = [json.loads(line) for line in (run / "rollbacks.jsonl").read_text().splitlines()]
    assert records, "the setting collapsed in every measured seed: a rollback was expected"
    for i, rec in enumerate(records, start=1):
        assert rec["rollback"] == i and rec["restored_step"] < rec["step"] and rec["reasons"]
        assert rec["lr_scale"] == pytest.approx(0.5 ** i)
        abandoned = (run / "rollbacks" / f"rollback_{i}_metrics.jsonl").read_text().splitlines()
        assert len(abandoned) == rec["step"] - rec["restored_step"]
    assert [m["step"] for m in metrics] == list(range(1, 13))  # the log is the kept lineage, in order
    assert metrics[-1]["policy/lr_scale"] == pytest.approx(0.5 ** len(records))
    assert metrics[-1]["health/rollbacks"] == len(records)
    assert metrics[-1]["policy/lr"] == pytest.approx(2e-4 * 0.5 ** len(records))
    assert latest_checkpoint(run).name == "step_12"
    restored = json.loads((run / "checkpoints" / f"step_{records[0]['restored_step']}" / "controller.json").read_text())
    assert restored["health"]["rollbacks"] >= 1 and restored["health"]["lr_scale"] < 1  # a resume keeps the rollback
    base, final = result.base_eval["held_out"], result.final_eval["held_out"]
    assert final > base - 0.15, (base, final)
