"""The whole loop through real Ray, Serve and DeepSpeed: it learns, writes its run folder, resumes."""
from __future__ import annotations

import json
import shutil

import pytest
from typer.testing import CliRunner

from tests.helpers import ensure_digits_app
from steadyrl.services.config import CONFIG_DIR
from steadyrl.services.driver.cli import app
from steadyrl.services.driver.controller import latest_checkpoint, train
from steadyrl.services.run_folder.metrics import read_metrics

SMOKE = CONFIG_DIR / "smoke.yaml"


@pytest.fixture(scope="module")
def smoke_run(ray_cluster, serve_port, tmp_path_factory):
    """configs/smoke.yaml, 30 steps. Measured with `steadyrl train --local` on base-model seeds 0/1/2
    (pretrain.seed): gold accuracy +21/+23/+20 points, proxy reward +0.15/+0.15/+0.10 over the last 5 steps; the
    asserted +0.05 holds for each."""
    ensure_digits_app()
    run_dir = tmp_path_factory.mktemp("smoke") / "run"
    result = train(SMOKE, [f"run.run_dir={run_dir}"])
    assert not result.interrupted and result.steps_done == 30
    return result


@pytest.fixture(scope="module")
def flow_run(ray_cluster, serve_port, tmp_path_factory):
    """The rectified-flow preset, cut to 20 steps of 8 images per class. Measured with `steadyrl train --local` on
    base-model seeds 0/1/2 (pretrain.seed): gold accuracy +10/+19/+18 points, proxy reward +0.10/+0.15/+0.10 over
    the last 5 steps; the asserted +0.05 holds for each."""
    ensure_digits_app()
    run_dir = tmp_path_factory.mktemp("flow") / "run"
    result = train(CONFIG_DIR / "digits-flow-grpo.yaml",
                   [f"run.run_dir={run_dir}", "run.steps=20", "run.eval_every=20", "run.checkpoint_every=20",
                    "testbed.eval_samples_per_class=30", "run.progress=false", "serve.port=0",
                    "sampler.group_size=8"])
    assert not result.interrupted and result.steps_done == 20
    return result


def test_rectified_flow_preset_learns_through_the_same_services(flow_run):
    rows = read_metrics(flow_run.run_dir)
    first = rows[0]["reward/train_mean"]
    last5 = sum(r["reward/train_mean"] for r in rows[-5:]) / 5
    assert last5 >= first + 0.05, (first, last5)
    base, final = flow_run.base_eval, flow_run.final_eval
    assert final["held_out"] >= base["held_out"] + 0.05, (base["held_out"], final["held_out"])
    assert max(r["policy/rollout_logp_absdiff_max"] for r in rows) < 1e-3


def test_rl_improves_proxy_reward_and_gold_accuracy(smoke_run):
    rows = read_metrics(smoke_run.run_dir)
    first = rows[0]["reward/train_mean"]  # the batch sampled by the base model at step 0
    last5 = sum(r["reward/train_mean"] for r in rows[-5:]) / 5
    assert last5 >= first + 0.05, (first, last5)
    base, final = smoke_run.base_eval, smoke_run.final_eval
    assert base["step"] == 0 and final["step"] == 30
    assert base["n_samples"] == final["n_samples"] == 300  # same seed: the same initial noise
    assert final["held_out"] >= base["held_out"] + 0.05, (base["held_out"], final["held_out"])


def test_run_folder_has_config_metrics_plots_checkpoints_and_logs(smoke_run):
    d = smoke_run.run_dir
    rows = read_metrics(d)
    assert [r["step"] for r in rows] == list(range(1, 31))
    for key in ("timing_s/rollout", "timing_s/reward", "timing_s/update", "timing_s/sync", "policy/kl_ref_monitor",
                "policy/clip_frac", "policy/grad_norm", "reward/held_out", "diversity/nn_distance"):
        assert key in rows[0], key
    # float32 ratio invariant (b): recompute vs rollout stays below the alarm level every step
    assert max(r["policy/rollout_logp_absdiff_max"] for r in rows) < 1e-3
    assert (d / "config.yaml").exists() and list((d / "tensorboard").glob("events.out.tfevents.*"))
    for png in ("samples_step_0000.png", "samples_step_0030.png", "curves.png"):
        assert (d / png).stat().st_size > 1000, png
    assert latest_checkpoint(d) == d / "checkpoints" / "step_30"
    assert (d / "checkpoints" / "step_15" / "policy.safetensors").exists()
    assert not list((d / "checkpoints").glob(".*tmp*"))
    assert (d / "logs" / "learner_0.log").exists() and (d / "logs" / "rollout_0.log").exists()
    evals = json.loads((d / "evals.json").read_text())
    assert [e["step"] for e in evals] == [0, 30]


def test_eval_cli_scores_the_latest_checkpoint(smoke_run):
    result = CliRunner().invoke(app, ["eval", str(smoke_run.run_dir)])
    assert result.exit_code == 0, result.output
    out = json.loads((smoke_run.run_dir / "eval_step_30" / "eval.json").read_text())
    assert out["n_samples"] == 300 and len(out["held_out_per_class"]) == 10
    # same weights and seeded noise as the controller's final eval (float32 numerics may differ slightly)
    assert abs(out["held_out"] - smoke_run.final_eval["held_out"]) <= 0.03
    assert (smoke_run.run_dir / "eval_step_30" / "samples.png").exists()


def test_resume_continues_from_the_latest_checkpoint(smoke_run, tmp_path):
    run_dir = tmp_path / "resumed"
    shutil.copytree(smoke_run.run_dir, run_dir)
    # pretend the run crashed after step 30 with two more logged steps that no checkpoint holds
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 31, "reward/train_mean": 0.0}) + "\n")
    # resume with two rollout workers: their batches (distinct group ids) are joined in the learner. That changes
    # the sampling noise (seeded per worker), so the resume has to be told it may
    result = train(overrides=["run.steps=32", "run.eval_every=100", "ray.rollout_workers=2"], resume_dir=run_dir,
                   allow_changes=True)
    assert result.steps_done == 32 and not result.interrupted
    assert json.loads((run_dir / "resumes.jsonl").read_text())["meaning_changed"] == ["ray.rollout_workers"]
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 33))
    assert rows[30]["reward/train_mean"] > 0.5  # the stale row 31 was replaced by a real one
    assert latest_checkpoint(run_dir).name == "step_32"
    assert rows[31]["perf/samples_per_s"] > 0 and rows[31]["policy/optimizer_steps"] == 6  # 80 samples / 32 -> 3, x 2


@pytest.mark.parametrize("objective, own_keys", [
    ("gardo.paper", ["gardo/gate_frac", "gardo/beta", "gardo/kl_gated", "gardo/resets", "policy/ratio_std",
                     "gardo/std_weight_max"]),
    ("draft", ["reward/backprop_mean"]),
])
def test_new_objectives_run_through_the_services_and_log_their_diagnostics(ray_cluster, digits_app, tmp_path, objective,
                                                                           own_keys):
    """GARDO reads the Serve ensemble's per-model scores and features; DRaFT's learner actor loads the
    differentiable training reward itself. Both log their own keys to metrics.jsonl and TensorBoard. GARDO's run
    also answers an anomaly at every step (a disagreement threshold every batch passes): the learner actor saves
    the batch into the run folder and the next update runs with the KL weight raised."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    preset = CONFIG_DIR / f"digits-{objective.replace('.', '-')}.yaml"
    anomaly = ["health.anomaly.enabled=true", "health.anomaly.disagreement=1e-6"] if objective == "gardo.paper" else []
    result = train(preset, [f"run.run_dir={tmp_path / 'run'}", "run.steps=2", "run.eval_every=100",
                            "run.checkpoint_every=2", "testbed.eval_samples_per_class=2", "run.progress=false",
                            "serve.port=0", "sampler.group_size=4", *anomaly])
    assert result.steps_done == 2
    rows = read_metrics(result.run_dir)
    if anomaly:
        assert (result.run_dir / "anomalies" / "step_0001" / "batch.safetensors").exists()
        assert rows[1]["policy/kl_weight"] == pytest.approx(10 * rows[0]["policy/kl_weight"], rel=1e-12)
    for key in own_keys + ["policy/grad_norm", "policy/kl_ref_monitor"]:
        assert all(key in r for r in rows), key
    assert rows[-1]["policy/grad_norm"] > 0
    events = EventAccumulator(str(result.run_dir / "tensorboard")).Reload()
    assert set(own_keys) <= set(events.Tags()["scalars"])
