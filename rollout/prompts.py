"""Prompt sets for text-to-image training: loading, train/eval splits and the prompts of each RL step.

A prompt set is a shipped name ("animals", see `shipped_prompt_sets()`) or a file:
  .txt    one prompt per line; blank lines and lines starting with '#' are skipped; surrounding
          whitespace is stripped.
  .jsonl  one JSON object per line with a required non-empty string "prompt"; every other key is that
          prompt's metadata (for rewards that need it, e.g. {"tag": "counting", "count": 3}); blank
          lines are skipped.
Duplicate prompts are kept: listing a prompt twice is a legitimate way to weight it (it is then drawn
twice per pass over the set). Splits are therefore disjoint by index, not by text.

Which prompts a step uses is a pure function of (train_seed, step) and the split sizes: workers, resumed
runs and evaluations agree without passing prompts around (as in the arith testbed).
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from pydantic import Field, field_validator
from torch import Tensor

from steadyrl.rollout.data_files import is_shipped_name, resolve_data_file, shipped_files
from steadyrl.rollout.settings_base import StrictModel

PROMPT_SETS_DIR = Path(__file__).resolve().parent / "prompt_sets"
SUFFIXES = (".txt", ".jsonl")

# salts that keep the split's and the steps' random streams apart even when their seeds are equal
_SPLIT_STREAM, _STEP_STREAM, _EVAL_CAP_STREAM = 0x5EED5, 0x57E95, 0xCA9


# ------------------------------------------------------------------------------------------ prompt sets
@dataclass(frozen=True)
class PromptSet:
    """Prompts and their per-prompt metadata (same length; {} where a prompt has none)."""

    prompts: tuple[str, ...]
    metadata: tuple[dict, ...] = field(default=())
    name: str = "prompts"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompts", tuple(self.prompts))
        meta = tuple(self.metadata) if self.metadata else tuple({} for _ in self.prompts)
        object.__setattr__(self, "metadata", meta)
        if len(self.metadata) != len(self.prompts):
            raise ValueError(f"prompt set {self.name!r}: {len(self.prompts)} prompts but "
                             f"{len(self.metadata)} metadata entries")

    def __len__(self) -> int:
        return len(self.prompts)

    def subset(self, indices: Sequence[int] | Tensor | np.ndarray, name: str | None = None) -> PromptSet:
        """The prompts at `indices` (in that order, repeats allowed); `name` defaults to this set's."""
        idx = [int(i) for i in (indices.tolist() if isinstance(indices, (Tensor, np.ndarray)) else indices)]
        bad = [i for i in idx if not 0 <= i < len(self)]
        if bad:
            raise IndexError(f"prompt set {self.name!r} has {len(self)} prompts; indices {bad[:5]} are out of range")
        return PromptSet(tuple(self.prompts[i] for i in idx), tuple(self.metadata[i] for i in idx),
                         self.name if name is None else name)


def shipped_prompt_sets() -> dict[str, Path]:
    """The prompt sets shipped in the package (rollout/prompt_sets/), by name (the file's stem)."""
    return shipped_files(PROMPT_SETS_DIR, SUFFIXES)


def _resolve(source: str | Path) -> Path:
    return resolve_data_file(source, PROMPT_SETS_DIR, SUFFIXES, "prompt set")


def _parse_txt(path: Path, text: str) -> tuple[list[str], list[dict]]:
    prompts = [s for s in (line.strip() for line in text.splitlines()) if s and not s.startswith("#")]
    return prompts, [{} for _ in prompts]


def _parse_jsonl(path: Path, text: str) -> tuple[list[str], list[dict]]:
    prompts, metadata = [], []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"prompt file {path}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: malformed JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise ValueError(f'{where}: expected a JSON object with a "prompt" key, got {type(obj).__name__}')
        if "prompt" not in obj:
            raise ValueError(f'{where}: missing the required "prompt" key')
        prompt = obj.pop("prompt")
        if not isinstance(prompt, str):
            raise ValueError(f'{where}: "prompt" must be a string, got {type(prompt).__name__}')
        if not prompt.strip():
            raise ValueError(f'{where}: "prompt" is empty')
        prompts.append(prompt.strip())
        metadata.append(obj)
    return prompts, metadata


def load_prompt_set(source: str | Path) -> PromptSet:
    """A shipped set by name ("animals") or a .txt / .jsonl file (format in the module docstring).
    Raises ValueError naming the file and 1-based line for a bad line, an unknown extension or shipped
    name (listing the shipped ones), and an empty set; FileNotFoundError for a missing file."""
    path = _resolve(source)
    text = path.read_text(encoding="utf-8-sig")
    prompts, metadata = (_parse_txt if path.suffix.lower() == ".txt" else _parse_jsonl)(path, text)
    if not prompts:
        raise ValueError(f"prompt file {path} has no prompts")
    return PromptSet(tuple(prompts), tuple(metadata), source if is_shipped_name(source) else path.stem)


# ------------------------------------------------------------------------------------------------ config
class PromptsConfig(StrictModel):
    """Which prompts a text-to-image run trains and evaluates on, and how many each RL step uses."""

    train: str = Field("animals", min_length=1, description="training prompts: a shipped set's name "
                       "(rollout/prompt_sets/) or a path to a .txt / .jsonl file")
    eval: str | None = Field(None, min_length=1, description="a separate evaluation set (name or path); None = "
                             "split `eval_fraction` of `train` off, so that eval measures held-out prompts")
    eval_fraction: float = Field(0.2, gt=0.0, lt=1.0, description="share of `train` held out for evaluation when "
                                 "`eval` is None (both splits must end up non-empty)")
    split_seed: int = Field(0, ge=0, description="seed of the train/eval split's permutation, fixed apart from "
                            "train_seed so that changing the training order does not change the held-out prompts")
    prompts_per_step: int = Field(8, ge=1, description="distinct prompts per RL step, split over rollout workers; "
                                  "each gets `sampler.group_size` images (one GRPO group)")
    eval_prompts: int | None = Field(None, ge=1, description="cap on evaluation prompts (a seeded sample, for "
                                     "cheaper evals of a big set); None = all")
    train_seed: int = Field(0, ge=0, description="seed of the order in which training prompts are drawn (a "
                            "fresh shuffle per pass over the train split)")

    @field_validator("train", "eval")
    @classmethod
    def _known(cls, v: str | None) -> str | None:
        """Fail at config time on what can be checked anywhere: a shipped name or a file's extension
        (whether a path exists is checked when it is loaded, on the machine that loads it)."""
        if v is None:
            return v
        if is_shipped_name(v):
            shipped = shipped_prompt_sets()
            if v not in shipped:
                raise ValueError(f"unknown prompt set {v!r}: the shipped sets are {', '.join(shipped) or 'none'} "
                                 f"(or give a path to a {' or '.join(SUFFIXES)} file)")
        elif Path(v).suffix.lower() not in SUFFIXES:
            raise ValueError(f"{v!r} has an unknown extension; expected {' or '.join(SUFFIXES)}")
        return v


# ------------------------------------------------------------------------------------------------ splits
@dataclass(frozen=True)
class PromptSplits:
    """The train and eval prompt sets, and the indices each was taken at (train: into the `train` file;
    eval: into the `train` file when split from it, else into the `eval` file)."""

    train: PromptSet
    eval: PromptSet
    train_indices: tuple[int, ...]
    eval_indices: tuple[int, ...]


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([int(k) for k in key])


def build_splits(cfg: PromptsConfig) -> PromptSplits:
    """Train and eval sets. With `eval` None, a permutation seeded by `split_seed` holds out
    round(eval_fraction * n) prompts of `train` (disjoint by index; each split keeps file order).
    `eval_prompts` then caps the eval set by a seeded sample."""
    full = load_prompt_set(cfg.train)
    n = len(full)
    if cfg.eval is None:
        n_eval = math.floor(cfg.eval_fraction * n + 0.5)
        if not 0 < n_eval < n:
            raise ValueError(f"prompts.eval_fraction={cfg.eval_fraction} of the {n} prompts of {full.name!r} leaves "
                             f"{'no eval' if n_eval == 0 else 'no train'} prompts; change prompts.eval_fraction "
                             f"or give a separate prompts.eval set")
        perm = _rng(cfg.split_seed, _SPLIT_STREAM).permutation(n)
        train_idx = tuple(sorted(perm[n_eval:].tolist()))
        eval_idx = perm[:n_eval].tolist()
        eval_source = full
    else:
        train_idx = tuple(range(n))
        eval_source = load_prompt_set(cfg.eval)
        eval_idx = list(range(len(eval_source)))
    if cfg.eval_prompts is not None and cfg.eval_prompts < len(eval_idx):
        pick = _rng(cfg.split_seed, _EVAL_CAP_STREAM).permutation(len(eval_idx))[: cfg.eval_prompts]
        eval_idx = [eval_idx[i] for i in pick.tolist()]
    eval_idx = tuple(sorted(eval_idx))
    return PromptSplits(train=full.subset(train_idx, f"{full.name}:train"),
                        eval=eval_source.subset(eval_idx, f"{eval_source.name}:eval"),
                        train_indices=train_idx, eval_indices=eval_idx)


# ----------------------------------------------------------------------------------------- step prompts
# The train split is walked as a stream of passes (epochs), each a fresh permutation seeded by
# (train_seed, epoch); step s takes stream positions [s * P, (s + 1) * P). Every prompt is thus used once
# per pass. A step that straddles two passes would repeat a prompt if the new pass began with one the old
# pass ended with, so the new pass moves its first P - k prompts that are not among the k the old pass
# gave that step to its front (the rest keep their order). That changes only the pass's first <= P
# positions, so a pass's tail is its raw permutation's when n >= 2P; for P <= n < 2P the passes are
# rebuilt from the last one that starts on a step boundary (at most P / gcd(n, P) of them).

def _raw_pass(seed: int, n: int, epoch: int) -> np.ndarray:
    return _rng(seed, _STEP_STREAM, epoch).permutation(n)


def _front_distinct(raw: np.ndarray, tail: np.ndarray, head: int) -> np.ndarray:
    """`raw` with its first `head` entries not in `tail` moved to the front (stable otherwise)."""
    if tail.size == 0:
        return raw
    pos = np.flatnonzero(~np.isin(raw, tail))[:head]
    keep = np.ones(raw.size, dtype=bool)
    keep[pos] = False
    return np.concatenate([raw[pos], raw[keep]])


@lru_cache(maxsize=16)
def _pass_order(seed: int, n: int, per_step: int, epoch: int) -> np.ndarray:
    """The order of pass `epoch` over n train prompts (read-only)."""
    period = per_step // math.gcd(n, per_step)  # passes starting on a step boundary: multiples of `period`
    first = epoch - 1 if n >= 2 * per_step else (epoch // period) * period
    first = max(first, 0)
    order = _raw_pass(seed, n, first)
    for e in range(first + 1, epoch + 1):
        k = (e * n) % per_step  # prompts of the straddling step that pass e - 1 gives
        order = _front_distinct(_raw_pass(seed, n, e), order[n - k:] if k else order[:0], per_step - k)
    order.setflags(write=False)
    return order


def step_indices(cfg: PromptsConfig, n_train: int, step: int) -> np.ndarray:
    """All `prompts_per_step` distinct train-split indices of `step` (before splitting over workers)."""
    per = cfg.prompts_per_step
    if per > n_train:
        raise ValueError(f"prompts.prompts_per_step={per} exceeds the {n_train} train prompts (a step's prompts "
                         f"are distinct); lower it or use a bigger prompts.train set")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    start = step * per
    epoch, offset = divmod(start, n_train)
    order = _pass_order(cfg.train_seed, n_train, per, epoch)
    if offset + per <= n_train:
        return order[offset:offset + per].copy()
    rest = per - (n_train - offset)
    return np.concatenate([order[offset:], _pass_order(cfg.train_seed, n_train, per, epoch + 1)[:rest]])


def step_prompts(cfg: PromptsConfig, n_train: int, step: int, worker: int, n_workers: int) -> tuple[Tensor, int]:
    """`worker`'s share of the prompts of `step`: their indices into the train split ([m] LongTensor) and the
    worker's first group id. Shares follow numpy.array_split over the step's `prompts_per_step` prompts;
    groups are numbered step-locally from 0 across workers (worker w's first id = prompts of workers < w)."""
    per = cfg.prompts_per_step
    if n_workers < 1 or n_workers > per:
        raise ValueError(f"ray.rollout_workers={n_workers} must be between 1 and prompts.prompts_per_step={per} "
                         f"(every worker samples at least one prompt)")
    if not 0 <= worker < n_workers:
        raise ValueError(f"worker {worker} is not one of the {n_workers} rollout workers")
    share = np.array_split(np.arange(per), n_workers)[worker]
    idx = step_indices(cfg, n_train, step)[share]
    return torch.as_tensor(idx, dtype=torch.long), int(share[0])


__all__ = ["PromptSet", "PromptSplits", "PromptsConfig", "build_splits", "load_prompt_set",
                "shipped_prompt_sets", "step_indices", "step_prompts"]
