"""A task file as a dLLM testbed's data: rows split into training and held-out ones, prompts rendered (the
model's chat template where its tokenizer has one) and encoded to one left-padded width.

    held-out rows  the first `eval_rows` rows of `eval_file`, else `eval_rows` rows of `task_file` drawn with
                   `split_seed`
    training rows  the rest of `task_file`; step s takes rows (s * per_step + k) of a fresh permutation per
                   pass over them (seeded by `train_seed` and the pass), so every worker and a resumed run
                   agree without passing rows around
    width          the longest encoded prompt of both splits: every batch has the same prompt width, so the
                   rollout workers' batches concatenate; a prompt longer than `max_prompt_length` is an error
                   naming its row
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Sequence

import torch
from pydantic import Field, field_validator
from torch import Tensor

from steadyrl.rollout.data_files import is_shipped_name
from steadyrl.rollout.settings_base import StrictModel
from steadyrl.rollout.task_file_reader import TaskRow, load_task_file, render_prompt
from steadyrl.rollout.text_codec import TextCodec


def chat_tokenizer(codec: TextCodec) -> Any:
    """The transformers tokenizer behind a codec (for its chat template), None for the character tokenizer."""
    return getattr(codec, "tokenizer", None)


def rendered_prompt(row: TaskRow, codec: TextCodec, system_prompt: str | None = None) -> str:
    """The text the model is prompted with for `row`: its question in the codec's chat template, if any."""
    return render_prompt(row.question, chat_tokenizer(codec), system_prompt)


def prompt_ids(row: TaskRow, codec: TextCodec, system_prompt: str | None = None, where: str = "task row",
               text: str | None = None) -> list[int]:
    """The token ids the model is prompted with for `row` (`text`: its `rendered_prompt`, when already made),
    encoded without special tokens."""
    text = rendered_prompt(row, codec, system_prompt) if text is None else text
    try:
        ids = codec.encode(text)
    except ValueError as err:
        raise ValueError(f"{where} ({row.question[:60]!r}) cannot be encoded: {err}") from None
    if not ids:
        raise ValueError(f"{where} ({row.question[:60]!r}) encodes to no tokens")
    return ids


class FileTaskSettings(StrictModel):
    """A task from files: where its rows come from, how they become prompts and which verifier scores them."""

    task_file: str = Field(description="training rows: a .jsonl / .parquet file, or a shipped name (arith_addition, "
                           "math_tiny, countdown_tiny, sudoku_tiny)")
    eval_file: str | None = Field(None, description="held-out rows (e.g. a GSM8K test split; its first "
                                  "testbed.eval_problems rows are evaluated); None: testbed.eval_problems rows of "
                                  "task_file are held out")
    question_field: str = "question"
    answer_field: str = "answer"
    system_prompt: str | None = Field(None, description="a system message before the question (in the chat template "
                                      "where the tokenizer has one)")
    verifier: Literal["math", "countdown", "sudoku"] = Field(
        "math", description="math: the final answer (\\boxed{}, ####, or the last number) equals the gold numerically "
        "or symbolically (math-verify); countdown: the equation uses each of the row's `numbers` once and reaches "
        "its `target`; sudoku: the grid keeps the row's `puzzle` givens and is valid")

    @field_validator("task_file", "eval_file")
    @classmethod
    def _absolute(cls, v: str | None) -> str | None:
        """A relative path becomes absolute here, so every Ray process (whatever its working directory) reads the
        same file; a shipped name stays a name."""
        return v if v is None or is_shipped_name(v) else str(Path(v).expanduser().resolve())

    def rows(self) -> tuple[tuple[TaskRow, ...], tuple[TaskRow, ...]]:
        """(rows of task_file, rows of eval_file or ())."""
        load = lambda f: load_task_file(f, self.question_field, self.answer_field)  # noqa: E731
        return load(self.task_file), (load(self.eval_file) if self.eval_file else ())


@dataclass
class FileTask:
    """Training and held-out rows of a task file, their prompts encoded by `codec` (module docstring)."""

    spec: FileTaskSettings
    codec: TextCodec
    eval_rows: int = 200
    split_seed: int = 303
    max_prompt_length: int = 512

    @cached_property
    def splits(self) -> tuple[tuple[TaskRow, ...], tuple[TaskRow, ...]]:
        """(training rows, held-out rows)."""
        rows, held_out = self.spec.rows()
        if held_out:
            return rows, held_out[:self.eval_rows]
        if self.eval_rows >= len(rows):
            raise ValueError(f"testbed.eval_problems={self.eval_rows} leaves no training rows of the "
                             f"{len(rows)} in {self.spec.task_file!r}: lower it or give testbed.eval_file")
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(self.split_seed)).tolist()
        return tuple(rows[i] for i in sorted(order[self.eval_rows:])), tuple(rows[i] for i in order[:self.eval_rows])

    @cached_property
    def encoded(self) -> tuple[list[list[int]], list[list[int]]]:
        """Prompt ids of the training and held-out rows; each checked against `max_prompt_length`."""
        out = []
        for name, rows in zip(("training", "held-out"), self.splits):
            source = self.spec.eval_file if name == "held-out" and self.spec.eval_file else self.spec.task_file
            ids = []
            for i, row in enumerate(rows):
                where = f"{name} row {i} of {source!r}"
                p = prompt_ids(row, self.codec, self.spec.system_prompt, where)
                if len(p) > self.max_prompt_length:
                    raise ValueError(f"{where} ({row.question[:60]!r}) is {len(p)} tokens, longer than "
                                     f"testbed.max_prompt_length={self.max_prompt_length}")
                ids.append(p)
            out.append(ids)
        return out[0], out[1]

    @property
    def width(self) -> int:
        """The prompt width every batch is padded to (the longest prompt of both splits)."""
        train, held_out = self.encoded
        return max(map(len, train + held_out))

    def _pad(self, rows: Sequence[list[int]]) -> Tensor:
        pad, width = self.codec.pad_id, self.width
        return torch.tensor([[pad] * (width - len(r)) + r for r in rows], dtype=torch.long)

    def train_indices(self, seed: int, ids: Sequence[int]) -> list[int]:
        """Training rows of global draw ids (step * per_step + k): a fresh permutation per pass."""
        n = len(self.splits[0])
        out = []
        for i in ids:
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + i // n))
            out.append(int(perm[i % n]))
        return out

    def train_prompts(self, seed: int, ids: Sequence[int]) -> Tensor:
        """[len(ids), width] left-padded prompts of the training rows drawn by `ids`."""
        train, _ = self.encoded
        return self._pad([train[i] for i in self.train_indices(seed, ids)])

    def eval_prompts(self) -> Tensor:
        """[held-out rows, width] left-padded prompts."""
        return self._pad(self.encoded[1])
