"""Reward-hacking detection and its response (`health.anomaly`), and the periodic KL schedule."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from steadyrl.services.config import ConfigError, load_config
from steadyrl.trainer.anomaly import AnomalyConfig, HackingDetector
from steadyrl.trainer.kl_schedule import KLScheduleConfig, kl_factor
from tests.helpers import train_local

ROOT = Path(__file__).resolve().parents[1]


def feed(detector: HackingDetector, proxy: list[float], gold: list[float]):
    events = []
    for step, (p, g) in enumerate(zip(proxy, gold), start=1):
        events.append(detector.observe(step, {"reward/train_mean": p, "reward/gold_mean": g}))
    return events


def test_divergence_is_the_proxys_relative_rise_minus_the_golds_relative_change():
    rng = np.random.default_rng(0)
    proxy = list(0.5 + 0.05 * np.arange(8) + 0.01 * rng.standard_normal(8))
    gold = list(0.9 - 0.03 * np.arange(8))
    detector = HackingDetector(AnomalyConfig(enabled=True, window=4, divergence=0.1))
    events = feed(detector, proxy, gold)
    p0, p, g0, g = np.mean(proxy[:4]), np.mean(proxy[4:]), np.mean(gold[:4]), np.mean(gold[4:])
    expected = (p - p0) / abs(p0) - (g - g0) / abs(g0)
    assert detector.divergence() == pytest.approx(expected, rel=1e-12)
    assert events[:7] == [None] * 7  # fewer than 2 x window rows: no verdict
    assert events[7].kind == "divergence" and events[7].value == pytest.approx(expected) and expected > 0.1


@pytest.mark.parametrize("proxy, gold", [([0.5] * 4 + [0.6] * 4, [0.9] * 4 + [0.95] * 4),  # both rise: learning
                                         ([0.6] * 4 + [0.5] * 4, [0.9] * 4 + [0.5] * 4)])  # both fall: collapse
def test_no_divergence_unless_the_proxy_rises_while_the_gold_falls(proxy, gold):
    detector = HackingDetector(AnomalyConfig(enabled=True, window=4, divergence=1e-9))
    assert feed(detector, proxy, gold) == [None] * 8 and detector.divergence() is None


def test_ensemble_disagreement_past_its_threshold_is_an_event():
    detector = HackingDetector(AnomalyConfig(enabled=True, disagreement=0.2))
    assert detector.observe(1, {"reward/uncertainty_mean": 0.19}) is None
    event = detector.observe(2, {"reward/uncertainty_mean": 0.25})
    assert (event.kind, event.value, event.threshold) == ("disagreement", 0.25, 0.2)


@pytest.mark.parametrize("u", [0, 1, 5, 8, 13])
def test_the_periodic_kl_schedule_cycles_from_one_to_end_ratio_and_back(u):
    cfg = KLScheduleConfig(kind="periodic", end_ratio=0.2, period=8)
    assert kl_factor(cfg, u) == pytest.approx(0.2 + 0.8 * (1 + math.cos(2 * math.pi * u / 8)) / 2, rel=1e-12)
    assert kl_factor(cfg, 4) == pytest.approx(0.2) and kl_factor(cfg, 16) == pytest.approx(1.0)


def test_period_is_required_by_the_periodic_schedule_and_only_by_it():
    with pytest.raises(ConfigError, match="learner.kl_schedule.period"):
        load_config(None, ["learner.kl_schedule.kind=periodic"])
    with pytest.raises(ConfigError, match="learner.kl_schedule.period"):
        load_config(None, ["learner.kl_schedule.kind=linear", "learner.kl_schedule.period=4"])


def test_the_response_needs_a_kl_term_to_raise():
    with pytest.raises(ConfigError, match="objective.kl_coef"):
        load_config(None, ["health.anomaly.enabled=true"])
    assert load_config(None, ["health.anomaly.enabled=true", "objective.kl_coef=0.01"]).health.anomaly.enabled


@pytest.mark.timeout(600)
def test_each_event_raises_the_kl_weight_for_the_next_updates_and_saves_its_batch(tmp_path):
    """A threshold every batch passes (the digits ensemble's three classifiers never rank alike): an event at every
    step; the next update's KL weight is kl_coef x kl_boost, the first batches are saved with their scores."""
    run = tmp_path / "run"
    _, metrics = train_local(ROOT / "configs" / "digits-grpo.yaml", run, [
        "run.steps=3", "run.eval_every=3", "testbed.eval_samples_per_class=2", "sampler.group_size=4",
        "objective.kl_coef=0.01", "health.anomaly.enabled=true", "health.anomaly.disagreement=1e-6",
        "health.anomaly.kl_boost=10", "health.anomaly.boost_steps=1", "health.anomaly.save_batches=2"])
    events = [json.loads(line) for line in (run / "anomalies.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events] == [1, 2, 3] and {e["kind"] for e in events} == {"disagreement"}
    assert [e["value"] for e in events] == pytest.approx([m["reward/uncertainty_mean"] for m in metrics])
    assert [e["until_step"] for e in events] == [2, 3, 4]
    assert [m["policy/kl_weight"] for m in metrics] == pytest.approx([0.01, 0.1, 0.1], rel=1e-12)
    assert [m["health/kl_boost"] for m in metrics] == [1.0, 10.0, 10.0]
    assert [m["health/anomaly_events"] for m in metrics] == [1.0, 2.0, 3.0]
    assert [e["batch"] for e in events] == ["anomalies/step_0001", "anomalies/step_0002", None]
    for event, row in zip(events[:2], metrics):
        with safe_open(str(run / event["batch"] / "batch.safetensors"), "pt") as f:
            names = f.metadata()["reward_names"].split(",")
            rewards, uncertainty = f.get_tensor("rewards"), f.get_tensor("uncertainty")
            assert f.get_tensor("samples").shape[0] == rewards.shape[0] == len(f.get_tensor("group"))
        assert names[:3] == ["cnn", "mlp", "linear"]
        assert float(rewards[:, names.index("cnn")].mean()) == pytest.approx(row["reward/train_mean"], rel=1e-5)
        assert float(uncertainty.mean()) == pytest.approx(row["reward/uncertainty_mean"], rel=1e-5)
