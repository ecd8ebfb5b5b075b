"""A run's metrics: metrics.jsonl (one JSON line per step), mirrored to TensorBoard and the trackers."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter


class MetricsWriter:
    """Appends one JSON line per step and mirrors scalars to TensorBoard and to the trackers `loggers` names
    (`run.loggers`: mlflow, wandb; `services.run_folder.trackers`), which also get `config` (continued on `resume`)."""

    def __init__(self, run_dir: Path, loggers: list[str] | tuple[str, ...] = (), config: dict[str, Any] | None = None,
                 resume: bool = False):
        self.path = run_dir / "metrics.jsonl"
        self.tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self.trackers: list[Any] = []
        if loggers:
            from steadyrl.services.run_folder.trackers import open_trackers

            self.trackers = open_trackers(list(loggers), run_dir, config or {}, resume)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, **{k: float(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and math.isfinite(float(v)):
                self.tb.add_scalar(k, float(v), step)
        self.tb.flush()
        for tracker in self.trackers:
            tracker.log(step, metrics)

    def close(self) -> None:
        self.tb.close()
        for tracker in self.trackers:
            tracker.close()


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
