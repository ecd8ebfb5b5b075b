"""The gold answers of a task file, found from the prompt a completion answered (training batches carry
prompt token ids; REST callers may send the question, the rendered prompt or its ids)."""
from __future__ import annotations

from typing import Sequence

from torch import Tensor

from steadyrl.reward.answer_verifiers import verify_answer
from steadyrl.rollout.task_file_dataset import FileTaskSettings, prompt_ids, rendered_prompt
from steadyrl.rollout.task_file_reader import TaskRow
from steadyrl.rollout.text_codec import TextCodec


class TaskAnswers:
    """Every row of a file task (both splits), by question text, rendered prompt text and prompt ids."""

    def __init__(self, settings: FileTaskSettings, codec: TextCodec):
        self.settings, self.codec = settings, codec
        self.by_text: dict[str, TaskRow] = {}
        self.by_ids: dict[tuple[int, ...], TaskRow] = {}
        train, held_out = settings.rows()
        for row in train + held_out:
            rendered = rendered_prompt(row, codec, settings.system_prompt)
            self.by_text.setdefault(row.question.strip(), row)
            self.by_text.setdefault(rendered.strip(), row)
            self.by_ids.setdefault(tuple(prompt_ids(row, codec, text=rendered)), row)

    def row(self, prompt: str | Sequence[int] | Tensor) -> TaskRow | None:
        """The row a prompt belongs to (left padding dropped from ids); None for a prompt of no row."""
        if isinstance(prompt, str):
            return self.by_text.get(prompt.strip())
        ids = prompt.tolist() if isinstance(prompt, Tensor) else list(prompt)
        start = next((i for i, t in enumerate(ids) if t != self.codec.pad_id), len(ids))
        return self.by_ids.get(tuple(ids[start:]))

    def score(self, prompt: str | Sequence[int] | Tensor, completion: str, partial_credit: bool = False) -> float:
        """The file's verifier on `completion` against the prompt's row; 0 for a prompt of no row."""
        row = self.row(prompt)
        return 0.0 if row is None else verify_answer(self.settings.verifier, completion, row, partial_credit)
