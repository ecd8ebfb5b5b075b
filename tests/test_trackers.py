"""Experiment trackers behind extras (`run.loggers`): MLflow on its file store and W&B offline get every step's
scalars and the config, read back with MLflow's client and from W&B's own offline transaction log; a resumed
run logs on into the same tracker run; a tracker that is not installed fails naming run.loggers."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
from steadyrl.services.run_folder.metrics import MetricsWriter
from steadyrl.services.run_folder.trackers import flatten
from steadyrl.services.run_folder.trackers import TRACKERS_FILE


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """No server, no account: MLflow's default store in the run folder and W&B's offline mode."""
    for var in ("MLFLOW_TRACKING_URI", "WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")


def mlflow_history(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    """{metric: [(step, value), ...]} and the params of the run's MLflow run, through MLflow's client."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir.resolve() / "mlruns").as_uri())
    run_id = json.loads((run_dir / TRACKERS_FILE).read_text())["mlflow"]
    run = client.get_run(run_id)
    history = {k: [(m.step, m.value) for m in client.get_metric_history(run_id, k)] for k in run.data.metrics}
    return history, run.data.params


def wandb_records(path: Path):
    """The protobuf records of a W&B transaction log (run-<id>.wandb; wandb>=0.2x has no Python reader of its
    own): a 7-byte header (b":W&B", magic, version), then LevelDB-log blocks of 32 KiB, each record a 7-byte
    header (crc32c u32, length u16 little-endian, type u8: 1 full, 2 first, 3 middle, 4 last) and its data."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, parts = path.read_bytes(), 32768, 7, b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            yield pb.Record.FromString(parts)
            parts = b""


def wandb_history(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, object]]:
    """{metric: [(step, value), ...]} and the config over every offline segment of the run's W&B run."""
    import wandb

    wandb.teardown()  # run.finish() returns before W&B's service process has flushed the log; this waits for it
    run_id = json.loads((run_dir / TRACKERS_FILE).read_text())["wandb"]
    history: dict[str, list[tuple[int, float]]] = {}
    config: dict[str, object] = {}
    files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}*/run-{run_id}.wandb"))  # -1...: same second
    assert files, "no offline W&B run"
    for f in files:
        for rec in wandb_records(f):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
                for k, v in items.items():
                    if not k.startswith("_"):
                        history.setdefault(k, []).append((int(items["_step"]), float(v)))
            elif kind in ("run", "config"):  # the config comes with the run record, updates as config records
                update = rec.run.config.update if kind == "run" else rec.config.update
                config.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in update})
    return history, config


def expected(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """What metrics.jsonl holds, as the trackers should: finite values only."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        for k, v in r.items():
            if k != "step" and math.isfinite(v):
                out.setdefault(k, []).append((int(r["step"]), v))
    return out


def test_each_step_and_the_config_reach_mlflow_and_wandb_and_a_resume_continues_the_same_runs(tmp_path):
    config = {"run": {"name": "tracked", "steps": 3}, "objective": {"name": "grpo", "eps_clip": 0.2}}
    steps = {1: {"reward/train_mean": 0.5, "policy/kl": math.nan}, 2: {"reward/train_mean": 0.625},
             3: {"reward/train_mean": 0.75, "health/adv_std": 1.25}}
    writer = MetricsWriter(tmp_path, ["mlflow", "wandb"], config)
    for step in (1, 2):
        writer.write(step, steps[step])
    writer.close()
    ids = json.loads((tmp_path / TRACKERS_FILE).read_text())
    writer = MetricsWriter(tmp_path, ["mlflow", "wandb"], {**config, "run": {"name": "tracked", "steps": 5}},
                           resume=True)
    writer.write(3, steps[3])
    writer.close()
    assert json.loads((tmp_path / TRACKERS_FILE).read_text()) == ids  # the same tracker runs, not new ones
    want = {"reward/train_mean": [(1, 0.5), (2, 0.625), (3, 0.75)], "health/adv_std": [(3, 1.25)]}
    history, params = mlflow_history(tmp_path)
    assert history == want
    assert params == {k: json.dumps(v) if not isinstance(v, str) else v for k, v in flatten(config).items()}
    history, wb_config = wandb_history(tmp_path)
    assert history == want
    assert wb_config["objective"] == {"name": "grpo", "eps_clip": 0.2} and wb_config["run"]["steps"] == 5


def test_a_local_run_and_its_resume_log_what_metrics_jsonl_holds(tmp_path):
    """The product loop (local runtime) with run.loggers=[mlflow,wandb]: 2 steps, then resumed to 3."""
    from steadyrl.services.driver.controller import train
    from steadyrl.services.run_folder.metrics import read_metrics
    from tests.helpers import train_local

    run = tmp_path / "run"
    train_local(CONFIG_DIR / "smoke.yaml", run, ["run.steps=2", "run.eval_every=2", "run.checkpoint_every=1",
                                                 "sampler.group_size=4", "testbed.eval_samples_per_class=1",
                                                 "run.loggers=[mlflow,wandb]"])
    train(resume_dir=run, overrides=["run.steps=3"])
    rows = read_metrics(run)
    assert [r["step"] for r in rows] == [1, 2, 3]
    want = expected(rows)
    assert mlflow_history(run)[0] == want
    assert wandb_history(run)[0] == want


def test_a_tracker_that_is_not_installed_is_refused_naming_run_loggers(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run.loggers: .*'wandb' is not installed: pip install 'steadyrl\[wandb\]'"):
        load_config(CONFIG_DIR / "smoke.yaml", ["run.loggers=[mlflow,wandb]"])
    with pytest.raises(ConfigError, match=r"run.loggers"):
        load_config(CONFIG_DIR / "smoke.yaml", ["run.loggers=[neptune]"])
    assert load_config(CONFIG_DIR / "smoke.yaml", ["run.loggers=[mlflow,mlflow]"]).run.loggers == ["mlflow"]
