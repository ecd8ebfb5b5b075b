"""Answer verifiers for task files (rollout/task_file_reader.py): completion text in, a score in [0, 1] out; one
module per kind (math_answers.py, countdown_answers.py, sudoku_answers.py), dispatched here by a row.

  math       1 if the completion's final answer equals the gold answer numerically or symbolically
             (math-verify: "\\boxed{\\frac{1}{2}}" == "0.5"), else 0.
  countdown  1 if the completion's equation uses each given number exactly once, only digits, + - * / ( )
             and whitespace, and evaluates to the target within 1e-5; else 0 (d1's rule; d1's 0.1 for a
             wrong or invalid equation is `format_score`, default 0).
  sudoku     1 if the completion's first N*N digits keep every given cell and fill a valid grid, else 0;
             partial_credit: d1's share of the blank cells holding the solution's digit.

The gold side (answer, numbers, target, puzzle) is configuration: a malformed one raises ValueError.
The completion is model output: every string is scored and nothing raises (malformed -> 0.0).
"""
from __future__ import annotations

from typing import Literal

from steadyrl.reward.countdown_answers import verify_countdown
from steadyrl.reward.math_answers import verify_math
from steadyrl.reward.sudoku_answers import verify_sudoku
from steadyrl.rollout.task_file_reader import TaskRow

Kind = Literal["math", "countdown", "sudoku"]


def _field(kind: str, row: TaskRow, *names: str):
    for name in names:
        if name in row.metadata and row.metadata[name] is not None:
            return row.metadata[name]
    raise ValueError(f"a {kind} task row needs the field {names[0]!r} (question: {row.question[:60]!r}); "
                     f"it has {sorted(row.metadata) or 'no other fields'}")


def verify_answer(kind: Kind, completion: str, row: TaskRow, partial_credit: bool = False) -> float:
    """The `kind` verifier on `completion`, its gold taken from the row: math <- row.answer; countdown <-
    metadata "numbers" (or "nums") and "target"; sudoku <- metadata "puzzle" (row.answer, if it has the
    puzzle's N*N digits, is the solution for partial credit). ValueError for an unknown kind or a row
    without the fields the kind needs (a configuration error, not model output)."""
    if kind == "math":
        if not str(row.answer).strip():
            raise ValueError(f"a math task row needs a non-empty answer (question: {row.question[:60]!r})")
        return verify_math(completion, row.answer)
    if kind == "countdown":
        return verify_countdown(completion, _field(kind, row, "numbers", "nums"), _field(kind, row, "target"))
    if kind == "sudoku":
        puzzle = str(_field(kind, row, "puzzle")).strip()
        answer = str(row.answer).strip()
        solution = answer if len(answer) == len(puzzle) and answer.isdigit() else None
        return verify_sudoku(completion, puzzle, solution, partial_credit)
    raise ValueError(f"unknown verifier kind {kind!r}; expected 'math', 'countdown' or 'sudoku'")
