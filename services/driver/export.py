"""`steadyrl export RUN_DIR OUT`: a run's checkpoint in the formats the ecosystem loads, with a model card.

The testbed writes its model (`Testbed.export`: diffusers pipeline or LoRA folders, transformers or peft folders);
this module picks the checkpoint, refuses a non-empty OUT unless told, writes everything into a hidden sibling
folder and renames it into place only when complete, so an error leaves nothing half-written.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from steadyrl.rollout.hf_export import NotMergeable
from steadyrl.rollout.model_sources import ModelsUnavailable, check_model_sources
from steadyrl.services.config import load_config
from steadyrl.services.driver.evaluate import checkpoint_policy
from steadyrl.services.run_folder.checkpoints import checkpoint_steps
from steadyrl.services.run_folder.model_card import ExportInfo, write_model_card
from steadyrl.services.run_folder.reader import check_run_folder, read_evals
from steadyrl.services.testbeds import build_testbed


class ExportError(ValueError):
    """A run folder, step or output folder an export cannot use; the message names it."""


def export_step(run_dir: Path, step: int | None) -> int:
    """`step`, or the latest checkpoint's; an `ExportError` naming the run or the step when there is none."""
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise ExportError(f"{run_dir} has no checkpoints (checkpoints/step_N): train it until `run.checkpoint_every`")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ExportError(f"--step {step}: {run_dir} has no checkpoint of that step; it has steps {steps}")
    return step


def check_out(out: Path, overwrite: bool) -> None:
    """OUT is new or empty, or `overwrite`; else an `ExportError` naming it."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ExportError(f"{out} is not empty: choose a new folder, or pass --overwrite to replace it")


def export_run(run_dir: str | Path, out: str | Path, step: int | None = None, merge: bool = False,
               overwrite: bool = False, command: str = "steadyrl export") -> tuple[Path, ExportInfo]:
    """Checkpoint `step` (default: the latest) of the run in `run_dir` exported into `out`, with README.md."""
    run_dir, out = check_run_folder(run_dir), Path(out).absolute()
    step = export_step(run_dir, step)
    check_out(out, overwrite)
    cfg = load_config(run_dir / "config.yaml")
    testbed = build_testbed(cfg)
    try:  # the base a checkpoint's policy (and a merge) is built on: missing offline, an error naming it
        check_model_sources(testbed.export_sources())
    except ModelsUnavailable as err:
        raise ExportError(f"{run_dir} cannot be exported on this machine: the checkpoint's policy is built on its base "
                          f"model (a merge fuses into it), and {err}") from None
    policy = checkpoint_policy(testbed, run_dir / "checkpoints" / f"step_{step}")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        try:
            info = testbed.export(policy, partial, merge)
        except NotMergeable as err:
            raise ExportError(f"--merge: in {run_dir}'s policy {err}; export the adapters (without --merge), "
                              "which load over the base as trained") from None
        write_model_card(partial, cfg, read_evals(run_dir), step, info, command)
        if out.exists():  # empty, or --overwrite: the old folder goes only once the new one is complete
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            out.rename(old)
            partial.rename(out)
            shutil.rmtree(old)
        else:
            partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out, info


OFFLINE_VALUES = ("1", "on", "yes", "true")


def hub_offline() -> bool:
    """HF_HUB_OFFLINE set (the `steadyrl` CLI sets it to 1 unless told otherwise), as huggingface_hub reads it."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in OFFLINE_VALUES


def push_to_hub(folder: Path, repo_id: str) -> str:
    """Upload an exported `folder` to the model repository `repo_id` on the Hugging Face Hub (made if missing):
    huggingface_hub's `create_repo(exist_ok=True)` and `upload_folder`, with its token (HF_TOKEN, or
    `hf auth login`). An `ExportError` when HF_HUB_OFFLINE is set, before any connection; returns the commit's
    URL."""
    if hub_offline():
        raise ExportError(f"--push-to-hub {repo_id} needs the network, and HF_HUB_OFFLINE="
                          f"{os.environ['HF_HUB_OFFLINE']} is set (the steadyrl CLI sets HF_HUB_OFFLINE=1 unless "
                          f"told otherwise): run with HF_HUB_OFFLINE=0, or upload the folder later with "
                          f"`hf upload {repo_id} {folder}`")
    from huggingface_hub import HfApi

    api = HfApi()
    api.create_repo(repo_id, repo_type="model", exist_ok=True)
    return str(api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                                 commit_message=f"steadyrl export of {folder.name}"))
