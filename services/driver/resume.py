"""What `steadyrl train --resume` may change: a resumed run continues the one in the folder, so an override
that would change what it computes (the objective, its settings, the sampler, the model, the seed, the number
of rollout workers, which picks the sampling noise...) is refused unless asked for, and every resume is
recorded in the run folder (`resumes.jsonl`), as torchtune checks a resumed run against its config.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from steadyrl.services.config import ConfigError, TrainConfig
from steadyrl.services.run_folder.trackers import flatten

RESUMES_LOG = "resumes.jsonl"

# Settings that change where or how long the run goes, never what a step computes.
RESUME_SAFE: frozenset[str] = frozenset({
    "run.steps", "run.progress", "run.runtime", "run.eval_every", "run.checkpoint_every", "run.run_dir",
    "run.loggers", "run.max_restarts", "run.target_held_out",
    "ray.address", "ray.num_cpus", "ray.actor_cpus", "ray.placement_timeout_s", "ray.learner_placement",
    "ray.step_timeout_s", "ray.max_rollout_retries", "ray.weight_sync", "ray.rollout_placement",
    "serve.host", "serve.port", "serve.replica_cpus", "serve.max_request_samples", "serve.max_body_bytes",
    "serve.auth_token_env", "serve.auth_token_file", "serve.request_timeout_s", "serve.max_retries",
    "serve.retry_backoff_s",
})
# Whole sections of settings that place or check the run's actors, never change what a step computes.
RESUME_SAFE_PREFIXES = ("ray.roles.", "ray.check_nodes", "run.resume")


def resume_safe(key: str) -> bool:
    """Whether changing the setting `key` (dotted) leaves what the run computes as it was."""
    return key in RESUME_SAFE or key.startswith(RESUME_SAFE_PREFIXES)


def config_changes(saved: TrainConfig, resumed: TrainConfig) -> dict[str, tuple[Any, Any]]:
    """Every setting whose value differs, as {dotted.name: (saved, resumed)}."""
    old, new = flatten(saved.model_dump(mode="json")), flatten(resumed.model_dump(mode="json"))
    return {k: (old.get(k), new.get(k)) for k in sorted(old.keys() | new.keys()) if old.get(k) != new.get(k)}


def meaning_changes(changes: dict[str, tuple[Any, Any]]) -> dict[str, tuple[Any, Any]]:
    """Those of `changes` that change what the run computes (outside the resume-safe settings)."""
    return {k: v for k, v in changes.items() if not resume_safe(k)}


def listed(changes: dict[str, tuple[Any, Any]]) -> str:
    """'key: saved -> resumed, ...' for an error message."""
    return ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items())


def check_resume(saved: TrainConfig, resumed: TrainConfig, from_step: int,
                 allow_changes: bool = False) -> dict[str, tuple[Any, Any]]:
    """The changes a resume makes; raises ConfigError naming each one outside RESUME_SAFE (unless
    `allow_changes`) and when run.steps does not reach past the checkpoint."""
    changes = config_changes(saved, resumed)
    meaning = meaning_changes(changes)
    if meaning and not allow_changes:
        raise ConfigError(f"--resume would change what the run computes ({listed(meaning)}); resume without these "
                          "overrides, start a new run, or pass --allow-changes to continue anyway (recorded in "
                          f"{RESUMES_LOG})")
    if resumed.run.steps <= from_step:
        raise ConfigError(f"run.steps={resumed.run.steps}: the latest checkpoint is already at step {from_step}; "
                          f"pass run.steps=N with N > {from_step} to train further")
    return changes


def record_resume(run_dir: Path, from_step: int, changes: dict[str, tuple[Any, Any]]) -> None:
    """Append one line to the run folder's resume log: when, from which step, and what changed."""
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "from_step": from_step,
             "changes": {k: {"saved": a, "resumed": b} for k, (a, b) in changes.items()},
             "meaning_changed": sorted(meaning_changes(changes))}
    with (Path(run_dir) / RESUMES_LOG).open("a") as f:
        f.write(json.dumps(entry) + "\n")


def auto_resume_from(cfg: TrainConfig) -> tuple[TrainConfig, int] | None:
    """run.resume=auto: run.run_dir's saved config and the step of its latest checkpoint to continue from, or None
    where the folder holds no checkpoint (the run starts there afresh). Raises ConfigError where the folder's run
    differs from `cfg` in a setting outside the resume-safe ones (the same rule as --resume)."""
    from steadyrl.services.config import load_config
    from steadyrl.services.run_folder.checkpoints import latest_state

    run_dir = Path(cfg.run.run_dir)  # set: the config checks it
    if not (run_dir / "config.yaml").exists():
        return None
    saved = load_config(run_dir / "config.yaml")
    meaning = meaning_changes(config_changes(saved, cfg))
    if meaning:
        raise ConfigError(f"run.resume=auto: {run_dir} holds a run whose config differs ({listed(meaning)}); set "
                          f"another run.run_dir, or continue that run with `steadyrl train --resume {run_dir}`")
    try:
        return saved, int(latest_state(run_dir)[1]["step"])
    except FileNotFoundError:
        return None
