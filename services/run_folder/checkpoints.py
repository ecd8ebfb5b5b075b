"""A run folder's checkpoints (`checkpoints/step_N`, the `latest` pointer) and the failure that points to them.

Each checkpoint is written in a temp folder and renamed into place, then `latest` moves: a crash at any
moment leaves the previous checkpoint whole.
"""
from __future__ import annotations

import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from steadyrl.rollout.cache import write_text_atomically

CHECKPOINTS = "checkpoints"
CONTROLLER_STATE = "controller.json"
ACTORS_FILE = "actors.json"  # where a Ray run lists its actors (role, pid, node)


class RunFailed(RuntimeError):
    """A failure the run cannot recover from in place (a learner rank died, a worker past its retries); the
    message names the component, the step, and how to resume from the last checkpoint. `cause`: what failed
    during which step, alone; `failed_step`: the step under way; `restartable`: a lost process or node (not the
    run's own error), which a restart from the last checkpoint on the nodes left may get past (`run.max_restarts`)."""

    def __init__(self, message: str, failed_step: int | None = None, restartable: bool = False,
                 cause: str | None = None):
        super().__init__(message)
        self.failed_step, self.restartable, self.cause = failed_step, restartable, cause or message


def latest_checkpoint(run_dir: Path) -> Path | None:
    pointer = Path(run_dir) / CHECKPOINTS / "latest"
    if not pointer.exists():
        return None
    path = Path(run_dir) / CHECKPOINTS / pointer.read_text().strip()
    return path if path.exists() else None


def latest_state(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The latest checkpoint's folder and its controller state (step, evaluations, rollouts in flight)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        raise FileNotFoundError(f"no checkpoint to resume from in {Path(run_dir) / CHECKPOINTS}")
    return ckpt, json.loads((ckpt / CONTROLLER_STATE).read_text())


@contextmanager
def new_checkpoint(run_dir: Path, step: int) -> Iterator[Path]:
    """Yields an empty temp folder to fill; on success it becomes checkpoints/step_N and `latest` points to it."""
    root = Path(run_dir) / CHECKPOINTS
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    write_text_atomically(root / "latest", final.name)


def resume_hint(run_dir: Path) -> str:
    """'; the last checkpoint, ..., is intact: resume with `steadyrl train --resume RUN`' (or: none yet)."""
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return "; no checkpoint was written yet"
    return f"; the last checkpoint, {ckpt}, is intact: resume with `steadyrl train --resume {run_dir}`"


def rollout_weights_file(version: int) -> str:
    """A checkpoint's file of the weights in-flight rollouts were launched with."""
    return f"rollout_policy_v{version}.safetensors"


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The steps of the run's whole checkpoints (`checkpoints/step_N`), ascending."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.exists():
        return []
    return sorted(int(p.name[len("step_"):]) for p in root.glob("step_*") if p.name[len("step_"):].isdigit()
                  and (p / CONTROLLER_STATE).exists())


def checkpoint_before(run_dir: Path, step: int) -> Path | None:
    """The newest checkpoint of a step before `step` (a rollback's target), or None."""
    earlier = [s for s in checkpoint_steps(run_dir) if s < step]
    return Path(run_dir) / CHECKPOINTS / f"step_{earlier[-1]}" if earlier else None


def drop_checkpoints_after(run_dir: Path, step: int) -> None:
    """A rollback to checkpoint `step`: `latest` points to it and the checkpoints after it (weights the run
    abandoned) are removed, so a resume continues from the rollback."""
    root = Path(run_dir) / CHECKPOINTS
    write_text_atomically(root / "latest", f"step_{step}")
    for s in checkpoint_steps(run_dir):
        if s > step:
            shutil.rmtree(root / f"step_{s}")
