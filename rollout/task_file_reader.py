"""Task files for diffusion-LM training on verifiable tasks (math word problems, countdown, sudoku):
loading them, and rendering a question as the prompt a model sees.

A task file is a shipped name ("math_tiny", see `shipped_task_files()`) or a file:
  .jsonl    one JSON object per line; blank lines are skipped.
  .parquet  one row per task (read with pandas / pyarrow).
Each row needs a non-empty string question (field "question" unless configured) and an answer (field
"answer" unless configured): a non-empty string, or a number, which is kept as its decimal text (72 and
72.0 -> "72", 0.5 -> "0.5"). Every other field is the row's metadata, for the verifier that needs it:
  math       {"question": "...", "answer": "18"}              answer: a number or LaTeX ("\\frac{1}{2}")
  countdown  {"question": "...", "answer": "(8-2)*4",
              "numbers": [8, 2, 4], "target": 24}            answer: one valid expression
  sudoku     {"question": "...", "answer": "1234341221434321",
              "puzzle": "1030040021000301"}                  N*N digits row-major, 0 = blank
(reward/answer_verifiers.py scores completions against these rows.) Row order is file order; duplicate
rows are kept.
"""
from __future__ import annotations

import json
import math
import numbers
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from steadyrl.rollout.data_files import resolve_data_file, shipped_files

TASK_FILES_DIR = Path(__file__).resolve().parent / "task_files_data"
SUFFIXES = (".jsonl", ".parquet")


@dataclass(frozen=True)
class TaskRow:
    """One task: the question text, its gold answer (text) and every other field of its row."""

    question: str
    answer: str
    metadata: dict = field(default_factory=dict, hash=False)


def shipped_task_files() -> dict[str, Path]:
    """The task files shipped in the package (rollout/task_files_data/), by name (the file's stem)."""
    return shipped_files(TASK_FILES_DIR, SUFFIXES)


def _resolve(source: str | Path) -> Path:
    return resolve_data_file(source, TASK_FILES_DIR, SUFFIXES, "task file")


# ------------------------------------------------------------------------------------------------ rows
def _plain(value: Any) -> Any:
    """Numpy scalars / arrays (from parquet) as plain Python values, recursively."""
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):
        return _plain(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _answer_text(where: str, name: str, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, numbers.Real)):
        raise ValueError(f"{where}: field {name!r} must be a string or a number, got {type(value).__name__}")
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where}: field {name!r} is empty")
        return value.strip()
    if isinstance(value, numbers.Integral):
        return str(int(value))
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{where}: field {name!r} is {value}, not a finite number")
    return str(int(value)) if value.is_integer() else repr(value)


def _row(where: str, obj: Any, question_field: str, answer_field: str) -> TaskRow:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with fields {question_field!r} and {answer_field!r}, "
                         f"got {type(obj).__name__}")
    obj = dict(obj)
    for name in (question_field, answer_field):
        if name not in obj or _is_missing(obj[name]):
            raise ValueError(f"{where}: missing field {name!r}")
    question = obj.pop(question_field)
    if not isinstance(question, str):
        raise ValueError(f"{where}: field {question_field!r} must be a string, got {type(question).__name__}")
    if not question.strip():
        raise ValueError(f"{where}: field {question_field!r} is empty")
    answer = _answer_text(where, answer_field, obj.pop(answer_field))
    return TaskRow(question.strip(), answer, obj)


def _jsonl_objects(path: Path) -> Iterator[tuple[str, Any]]:
    for lineno, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"task file {path}, line {lineno}"
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None


def _parquet_objects(path: Path) -> Iterator[tuple[str, Any]]:
    import pandas as pd

    try:
        frame = pd.read_parquet(path)
    except Exception as e:  # pyarrow's errors for a corrupt or non-parquet file
        raise ValueError(f"task file {path}: not a readable parquet file ({type(e).__name__}: {e})") from None
    for i, record in enumerate(frame.to_dict(orient="records"), start=1):
        yield f"task file {path}, row {i}", _plain(record)


def load_task_file(source: str | Path, question_field: str = "question",
                   answer_field: str = "answer") -> tuple[TaskRow, ...]:
    """The rows of a shipped task file (by name) or of a .jsonl / .parquet file (format in the module
    docstring). Raises FileNotFoundError for a missing file and ValueError naming the file, the 1-based
    line (jsonl) or row (parquet) and the field for a bad row, an unsupported extension or unknown
    shipped name (listing the supported ones), and a file without rows."""
    if question_field == answer_field:
        raise ValueError(f"question_field and answer_field are both {question_field!r}")
    path = _resolve(source)
    objects = _parquet_objects(path) if path.suffix.lower() == ".parquet" else _jsonl_objects(path)
    rows = tuple(_row(where, obj, question_field, answer_field) for where, obj in objects)
    if not rows:
        raise ValueError(f"task file {path} has no rows")
    return rows


# --------------------------------------------------------------------------------------------- prompts
def render_prompt(question: str, tokenizer: Any = None, system_prompt: str | None = None) -> str:
    """The text a model is prompted with. With a tokenizer that has a chat template: the template applied
    to [system message (if `system_prompt`), user message `question`] with the assistant turn opened
    (add_generation_prompt=True). Otherwise the plain question, preceded by `system_prompt` and a newline
    if one is given."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                   [{"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n{question}" if system_prompt else question
