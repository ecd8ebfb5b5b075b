"""Optional experiment trackers behind extras (`run.loggers`): MLflow (`steadyrl[mlflow]`, mlflow-skinny) and
Weights & Biases (`steadyrl[wandb]`). Each gets the run's config once and every step's finite scalars.

Where they write: MLflow to $MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns (MLflow keeps that
store in maintenance mode; it is allowed here because it needs no server); W&B in RUN_DIR/wandb, mode
$WANDB_MODE, else online with an API key ($WANDB_API_KEY) and offline without one. The tracker's run id is kept
in RUN_DIR/trackers.json, so `steadyrl train --resume` logs on into the same tracker run.
"""
from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol


TRACKERS_FILE = "trackers.json"


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}; lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


class Tracker(Protocol):
    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def _saved_ids(run_dir: Path) -> dict[str, str]:
    path = run_dir / TRACKERS_FILE
    return json.loads(path.read_text()) if path.exists() else {}


def _save_id(run_dir: Path, name: str, run_id: str) -> None:
    ids = {**_saved_ids(run_dir), name: run_id}
    (run_dir / TRACKERS_FILE).write_text(json.dumps(ids, indent=1) + "\n")


def _finite(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}


class MlflowTracker:
    """One MLflow run per steadyrl run (experiment = run.name, run name = the folder's name)."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resume: bool):
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # the default store below is a file store
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI") or (run_dir.resolve() / "mlruns").as_uri()
        self.client = MlflowClient(tracking_uri=uri)
        run_id = _saved_ids(run_dir).get("mlflow") if resume else None
        if run_id is None:
            name = str(config.get("run", {}).get("name", "steadyrl"))
            exp = self.client.get_experiment_by_name(name)
            exp_id = exp.experiment_id if exp else self.client.create_experiment(name)
            run_id = self.client.create_run(exp_id, run_name=run_dir.resolve().name).info.run_id
            _save_id(run_dir, "mlflow", run_id)
            params = [Param(k, json.dumps(v) if not isinstance(v, str) else v)
                      for k, v in flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run_id, params=params[i:i + 100])
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.client.log_text(run_id, json.dumps(config, indent=1), "config.json")  # the resumed one, if changed
        self.run_id = run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in _finite(metrics).items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class WandbTracker:
    """One W&B run per steadyrl run (project = run.name); offline unless an API key or $WANDB_MODE says so."""

    def __init__(self, run_dir: Path, config: dict[str, Any], resume: bool):
        import wandb

        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run_id = _saved_ids(run_dir).get("wandb") if resume else None
        self.run = wandb.init(project=str(config.get("run", {}).get("name", "steadyrl")), dir=str(run_dir),
                              name=run_dir.resolve().name, id=run_id, resume="allow" if run_id else None,
                              mode=mode, config=config, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))
        if run_id is None:
            _save_id(run_dir, "wandb", self.run.id)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(_finite(metrics), step=step)

    def close(self) -> None:
        self.run.finish()


TRACKERS = {"mlflow": MlflowTracker, "wandb": WandbTracker}


def open_trackers(names: list[str], run_dir: Path, config: dict[str, Any], resume: bool = False) -> list[Tracker]:
    """The trackers `run.loggers` names, started (or, on resume, continued) for this run folder."""
    return [TRACKERS[name](Path(run_dir), config, resume) for name in names]
