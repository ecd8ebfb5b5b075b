"""Exact verifiers for the arith testbed: text in, a score in [0, 1] out; malformed output scores 0.

  addition  1 if the completion (up to the first <eos>) is exactly the decimal sum of the prompt's
            operands, else 0 (no partial credit: a near-miss sum is still wrong).
  sudoku    exact: 1 if the 16 digits fill the grid validly and keep every given cell, else 0.
            partial credit: the share of the 12 units (rows, columns, boxes) holding 1-4 once each,
            0 if a given cell was changed or the output is not 16 digits 1-4.

Verifiers never raise on model output: any string is scored.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.reward.task_answers import TaskAnswers
from steadyrl.rollout.arith import TOKENIZER, Task, parse_sudoku_prompt, sudoku_units_ok
from steadyrl.rollout.settings_base import StrictModel
from steadyrl.rollout.task_file_dataset import FileTaskSettings
from steadyrl.rollout.text_codec import TextCodec, load_codec

FEATURE_BUCKETS = 1024

ADDITION_PROMPT = re.compile(r"^([0-9]+)\+([0-9]+)=$")  # ASCII: "²".isdigit() holds, int("²") raises
DECIMAL = re.compile(r"[0-9]+")
MAX_DIGITS = 1000  # longer numbers score 0: far past any task, and under Python's int-parsing limit (4300)


def verify_addition(prompt: str, completion: str) -> float:
    m = ADDITION_PROMPT.match(prompt)
    if m is None or not DECIMAL.fullmatch(completion) or (len(completion) > 1 and completion[0] == "0"):
        return 0.0
    if max(len(completion), *map(len, m.groups())) > MAX_DIGITS:
        return 0.0
    return float(int(completion) == int(m.group(1)) + int(m.group(2)))


def verify_sudoku(prompt: str, completion: str, partial_credit: bool = False) -> float:
    givens = parse_sudoku_prompt(prompt)
    if givens is None or len(completion) != 16 or any(c not in "1234" for c in completion):
        return 0.0
    if any(g != "0" and g != c for g, c in zip(givens, completion)):
        return 0.0
    units = sudoku_units_ok(completion)
    return sum(units) / len(units) if partial_credit else float(all(units))


def verify(task: Task, prompt: str, completion: str, partial_credit: bool = False) -> float:
    """The task's verifier on whitespace-free text (a subword tokenizer may decode '07+45=' with spaces)."""
    prompt, completion = "".join(prompt.split()), "".join(completion.split())
    if task == "addition":
        return verify_addition(prompt, completion)
    if task == "sudoku":
        return verify_sudoku(prompt, completion, partial_credit)
    raise ValueError(f"unknown arith task {task!r}")


class VerifierSpec(StrictModel):
    """The arith reward: which task's verifier (a file task's: `file.verifier`), and whether it gives partial
    credit (sudoku only)."""

    kind: Literal["verifier"] = "verifier"
    task: Literal["addition", "sudoku", "file"] = "addition"
    file: FileTaskSettings | None = Field(None, description="task=file: the task file, its prompts and verifier")
    partial_credit: bool = Field(False, description="sudoku: score the share of valid units, not just 0/1")
    name: str = "verifier"
    tokenizer: str | None = Field(None, description="decode token ids with this model's tokenizer (hub id or "
                                  "directory); None: the arith character tokenizer")
    trust_remote_code: bool = False
    eos_token_id: int | None = Field(None, description="the completion ends at this token (default: the tokenizer's)")
    pad_token_id: int | None = Field(None, description="left padding of prompts (default: the tokenizer's, else EOS)")


@dataclass
class VerifierReward:
    """The reward model interface over token ids: `score(completions [B, L], prompts [B, P]) -> [B]`. A file task
    finds each prompt's gold answer in its task file (`answers`, reward/task_answers.py)."""

    task: Literal["addition", "sudoku", "file"] = "addition"
    partial_credit: bool = False
    name: str = "verifier"
    codec: TextCodec = TOKENIZER
    answers: TaskAnswers | None = None

    @classmethod
    def from_spec(cls, spec: VerifierSpec) -> "VerifierReward":
        codec = load_codec(spec.tokenizer, spec.trust_remote_code, None, spec.eos_token_id, spec.pad_token_id)
        if (spec.task == "file") != (spec.file is not None):
            raise ValueError("a verifier scores a task file exactly when task='file' and `file` is set")
        answers = None if spec.file is None else TaskAnswers(spec.file, codec)
        return cls(task=spec.task, partial_credit=spec.partial_credit, name=spec.name, codec=codec, answers=answers)

    def prompt_text(self, p: Tensor | Sequence[int]) -> str:
        """A prompt's text: its token ids decoded, left padding dropped."""
        p = torch.as_tensor(p)
        return self.codec.decode(p[p != self.codec.pad_id])

    def reference_answer(self, prompt: Tensor | Sequence[int] | str) -> str | None:
        """The prompt's reference answer: a task file's gold answer, an addition's sum; None where there is none
        (a sudoku has many valid fillings; a prompt of no row)."""
        if self.answers is not None:
            row = self.answers.row(prompt)
            return None if row is None else row.answer
        text = prompt if isinstance(prompt, str) else self.prompt_text(prompt)
        m = ADDITION_PROMPT.match("".join(text.split())) if self.task == "addition" else None
        return None if m is None else str(int(m.group(1)) + int(m.group(2)))

    def _prompt(self, p: Tensor) -> str | Tensor:
        """A prompt as the verifier looks it up: token ids for a file task (its rows are keyed by ids), else text."""
        return p if self.answers is not None else self.codec.decode(p[p != self.codec.pad_id])

    def _score(self, prompts: list[str | Sequence[int] | Tensor], completions: list[str], pc: bool) -> Tensor:
        if self.answers is not None:
            values = [self.answers.score(p, c, pc) for p, c in zip(prompts, completions)]
        else:
            values = [verify(self.task, p, c, pc) for p, c in zip(prompts, completions)]
        return torch.tensor(values, dtype=torch.float32)

    def score_texts(self, prompts: list[str], completions: list[str], partial_credit: bool | None = None) -> Tensor:
        return self._score(prompts, completions, self.partial_credit if partial_credit is None else partial_credit)

    def score_items(self, prompts: list[str | list[int]], completions: list[str | list[int]]) -> tuple[Tensor, Tensor]:
        """(scores, exact 0/1) of text or token-id items (completion ids are decoded with this verifier's
        tokenizer; prompt ids are decoded, or for a file task looked up as they are)."""
        c = [x if isinstance(x, str) else self.codec.decode(x) for x in completions]
        p = [x if isinstance(x, str) or self.answers is not None else self.codec.decode(x) for x in prompts]
        return self._score(p, c, self.partial_credit), self._score(p, c, False)

    def score(self, samples: Tensor, cond: Tensor) -> Tensor:
        return self._score([self._prompt(p) for p in cond], [self.codec.decode(c) for c in samples],
                           self.partial_credit)

    def health_probe(self) -> None:
        """None: a pure function of text has no state to go stale."""
        return None

    def correct(self, samples: Tensor, cond: Tensor) -> Tensor:
        """Exact 0/1 correctness (no partial credit): the held-out accuracy this testbed reports."""
        return self._score([self._prompt(p) for p in cond], [self.codec.decode(c) for c in samples], False)

    def features(self, samples: Tensor) -> Tensor:
        """One-hot tokens, flattened [B, L*V]: Euclidean distance^2 / 2 between two = Hamming distance
        (a large vocabulary is hashed into FEATURE_BUCKETS ids first: Hamming up to rare collisions)."""
        ids = samples.long()
        width = max(len(self.codec), int(ids.max()) + 1 if ids.numel() else 1)  # a model may emit ids past its tokenizer
        if width > FEATURE_BUCKETS:
            ids, width = ids % FEATURE_BUCKETS, FEATURE_BUCKETS
        return torch.nn.functional.one_hot(ids, width).flatten(1).float()
