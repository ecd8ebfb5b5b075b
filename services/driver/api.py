"""The Python API, for notebooks and scripts (`import steadyrl`): `train` runs what `steadyrl train` runs and returns
a `Run`; `load_run` reopens a run folder as one. The CLI's `train` is a thin layer over `train` here: it parses
arguments, prints errors and exits with the run's status.

    run = steadyrl.train("configs/digits-grpo.yaml", ["run.steps=20"], runtime="local")
    run.metrics[-1], run.evaluations[-1], run.checkpoints, run.last_checkpoint
    policy = run.load_policy()             # the testbed's policy holding the last checkpoint's weights
    samples = run.sample(4, seed=0)        # images [N, C, H, W], or decoded text

A `Run` reads its folder afresh on every access (metrics, evaluations, checkpoints), so one reopened while the run
is still going sees it grow. docs/python-api.md has the fields and a notebook example.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.services.config import ConfigError, TrainConfig, load_config
from steadyrl.services.driver import controller
from steadyrl.services.driver.console import PROGRESS_STYLES
from steadyrl.services.driver.evaluate import checkpoint_dir, checkpoint_policy, seeded_samples
from steadyrl.services.run_folder.checkpoints import checkpoint_steps, latest_checkpoint
from steadyrl.services.run_folder.metrics import read_metrics
from steadyrl.services.run_folder.reader import check_run_folder, read_evals
from steadyrl.services.testbeds import build_testbed
from steadyrl.services.testbeds.base import PromptError, Testbed

RUNTIMES = ("ray", "local")


@dataclass
class Samples:
    """What `Run.sample` drew, prompt-major: sample i is of prompt i // n."""

    prompts: list[Any]  # each sample's prompt: a class id (digits), a prompt's text (text-to-image, language models)
    images: Tensor | None  # image testbeds: [N, C, H, W] as the reward models score them (text-to-image: decoded)
    texts: list[str] | None  # language-model testbeds: the decoded completions
    batch: RolloutBatch = field(repr=False)  # the sampler's own: samples (images, latents, tokens), log-probs, groups
    per_prompt: int = 1  # n: samples of each prompt
    step: int | None = None  # the checkpoint's step
    title: str = ""  # "<run folder name> step_N, seed S, n per prompt": the grid's title, the text file's header

    def __len__(self) -> int:
        return len(self.prompts)

    def save(self, path: str | Path) -> Path:
        """Write the samples as `steadyrl sample` does (services/driver/samples.py): images as a PNG grid (a row
        per prompt, its n samples across, labelled), texts as a text file (each prompt, then its completions).
        `path`: a .png / .txt file, or a folder (`samples_step_N.png` / `.txt` in it); returns the file."""
        from steadyrl.services.driver.samples import save_samples

        return save_samples(self, path)

    def __repr__(self) -> str:
        what = (f"images {list(self.images.shape)}" if self.images is not None else f"{len(self.texts or [])} texts")
        return f"Samples({len(self)} samples of {len(set(map(str, self.prompts)))} prompts: {what})"


@dataclass
class Run:
    """A run folder and the config it ran (config.yaml). Everything else is read from the folder when asked for;
    `result` is the controller's outcome (steps done, base and final evaluations, interrupted, exit status, mean
    seconds per phase) when `train` returned this run, None when `load_run` reopened it."""

    folder: Path
    config: TrainConfig = field(repr=False)
    result: controller.RunResult | None = field(default=None, compare=False, repr=False)

    @property
    def metrics(self) -> list[dict[str, float]]:
        """metrics.jsonl: one dict per training step, `step` and every metric logged."""
        return read_metrics(self.folder)

    @property
    def evaluations(self) -> list[dict[str, Any]]:
        """evals.json: the held-out evaluations, the base (step 0) first."""
        return read_evals(self.folder)

    @property
    def checkpoints(self) -> list[int]:
        """The steps of the run's checkpoints, ascending."""
        return checkpoint_steps(self.folder)

    @property
    def last_checkpoint(self) -> Path | None:
        """The latest checkpoint's folder (checkpoints/step_N, what a resume continues from), or None."""
        return latest_checkpoint(self.folder)

    @cached_property
    def testbed(self) -> Testbed:
        """The run's testbed (`testbed.name`): its policy, samplers, prompts and reward models."""
        return build_testbed(self.config)

    def load_policy(self, step: int | None = None) -> nn.Module:
        """The trained policy of checkpoint `step` (default: the last) as the testbed builds it, in eval mode on the
        CPU: `steadyrl eval`'s policy (policy.safetensors; a LoRA run's adapters over its base)."""
        return checkpoint_policy(self.testbed, checkpoint_dir(self.folder, step))

    def sample(self, n: int = 1, *, seed: int = 0, step: int | None = None,
               prompts: Tensor | Sequence[int] | str | Sequence[str] | None = None,
               steps: int | None = None) -> Samples:
        """`n` samples of each prompt from checkpoint `step` (default: the last), drawn as `steadyrl eval` draws
        them: the testbed's evaluation sampler (greedy for the language models), seeded with `seed`. `prompts`:
        prompt ids as the testbed takes them (digits: class ids 0-9), or prompt text, one string or a list
        (`Testbed.prompts_from_text`: digits "3" or "0,1,2", arith "07+45=", a text-to-image prompt); default its
        held-out evaluation prompts. `steps`: the sampler's denoising steps (`sampler.num_steps`) instead of the
        run's. `.save(path)` writes them as `steadyrl sample` does."""
        if n < 1:
            raise ValueError(f"n={n}: at least one sample of each prompt")
        ckpt = checkpoint_dir(self.folder, step)
        key = (ckpt, (ckpt / "policy.safetensors").stat().st_mtime_ns)
        if getattr(self, "_policy_key", None) != key:  # one policy kept: sampling again does not rebuild it
            self._policy, self._policy_key = checkpoint_policy(self.testbed, ckpt), key
        testbed, policy = self._sampling_testbed(steps), self._policy
        batch = seeded_samples(testbed, policy, prompt_ids(testbed, prompts), n, seed)
        shown, outputs = testbed.readable(policy, batch)
        images = outputs if isinstance(outputs, Tensor) else None
        title = f"{self.folder.name} {ckpt.name}, seed {seed}, {n} per prompt" + (f", {steps} steps" if steps else "")
        return Samples(shown, images, None if images is not None else list(outputs), batch, n,
                       int(ckpt.name.removeprefix("step_")), title)

    def _sampling_testbed(self, steps: int | None) -> Testbed:
        """The run's testbed, or with `steps` one whose sampler takes that many steps (kept for the next call)."""
        if steps is None or steps == self.config.sampler.num_steps:
            return self.testbed
        kept = self.__dict__.setdefault("_testbeds", {})
        if steps not in kept:  # validated as an override would be: a ConfigError names sampler.num_steps
            kept[steps] = build_testbed(load_config(self.folder / "config.yaml", [f"sampler.num_steps={steps}"]))
        return kept[steps]

    def __repr__(self) -> str:
        rows, last, cfg = self.metrics, self.last_checkpoint, self.config
        return (f"Run({str(self.folder)!r}: {cfg.testbed.name}, {cfg.objective.name}, "
                f"{int(rows[-1]['step']) if rows else 0}/{cfg.run.steps} steps, "
                f"last checkpoint {last.name if last else None})")


def prompt_ids(testbed: Testbed, prompts: Tensor | Sequence[int] | str | Sequence[str] | None) -> Tensor:
    """The testbed's prompt ids of `prompts` (`Run.sample`): its held-out ones for None, ids as given, or prompt
    text through `Testbed.prompts_from_text` (a `PromptError` names one it cannot take)."""
    if prompts is None:
        return testbed.eval_prompts()
    if isinstance(prompts, str):
        prompts = [prompts]
    if not isinstance(prompts, Tensor) and any(isinstance(p, str) for p in prompts):
        if not all(isinstance(p, str) for p in prompts):
            raise PromptError(f"prompts={list(prompts)!r}: all ids or all text, not both")
        prompts = testbed.prompts_from_text(list(prompts))
    if len(prompts) == 0:
        raise PromptError("prompts: none given")
    return torch.as_tensor(prompts)


def load_run(path: str | Path) -> Run:
    """Reopen a run folder written by `steadyrl train` or `train` (NotARunFolder, naming `path`, when it is not
    one)."""
    folder = check_run_folder(path)
    return Run(folder.absolute(), load_config(folder / "config.yaml"))


def override_list(overrides: Iterable[str] | Mapping[str, Any]) -> list[str]:
    """`key.sub=value` strings, from a list of them or a mapping {"key.sub": value} (each value written as JSON,
    which the overrides read as YAML: a str stays a str)."""
    if isinstance(overrides, str):
        raise ConfigError(f"overrides={overrides!r}: a list of 'key.sub=value' strings, or a mapping, not one string")
    if isinstance(overrides, Mapping):
        return [f"{k}={json.dumps(v, default=str)}" for k, v in overrides.items()]
    return [str(o) for o in overrides]


def train(config: str | Path | None = None, overrides: Iterable[str] | Mapping[str, Any] = (), *,
          runtime: str | None = None, resume: str | Path | None = None, allow_changes: bool = False,
          progress: str = "auto", console: Console | None = None) -> Run:
    """Run what `steadyrl train` runs, in this process: pre-train if needed, then RL to `run.steps`; returns the
    `Run`.

    config: a YAML preset (default configs/digits-grpo.yaml); overrides: ["key.sub=value", ...] or
    {"key.sub": value}; runtime: "ray" or "local" (`run.runtime`; None: the config's); resume: a run folder to
    continue from its latest checkpoint (its config with `overrides`, which must be resume-safe unless
    `allow_changes`); progress: "auto" (a live bar in a terminal or Jupyter, plain lines where output does not
    redraw: a file, a pipe, CI), "bar", "lines", or "none" (sets run.progress=false); console: where it prints
    (default: stdout).

    Raises ConfigError (a bad config or override, a model not to be had, Ray missing for the Ray runtime; before
    anything starts), FileNotFoundError (resume: no checkpoint) and RunFailed (a failure the run could not
    recover from). Ctrl-C stops the run at its last checkpoint and returns it (`result.interrupted`)."""
    overrides = override_list(overrides)
    if runtime is not None:
        if runtime not in RUNTIMES:
            raise ConfigError(f"runtime={runtime!r}: one of {', '.join(map(repr, RUNTIMES))} (run.runtime)")
        overrides.append(f"run.runtime={runtime}")
    if progress not in PROGRESS_STYLES:
        raise ConfigError(f"progress={progress!r}: one of {', '.join(map(repr, PROGRESS_STYLES))}")
    if progress == "none":
        overrides.append("run.progress=false")
    if allow_changes and resume is None:
        raise ConfigError("allow_changes=True only applies with resume=RUN_DIR")
    if resume is not None:
        if config is not None:
            raise ConfigError("with resume the config comes from the run folder; pass only overrides")
        if not (Path(resume) / "config.yaml").exists():
            raise ConfigError(f"resume={str(resume)!r}: no config.yaml there")
    result = controller.train(config, overrides, resume_dir=resume, console=console, allow_changes=allow_changes,
                              progress=progress)
    run = load_run(result.run_dir)
    run.result = result
    return run
