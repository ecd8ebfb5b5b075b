"""The arith testbeds' REST bodies: prompt/completion pairs as text or token ids of the app's tokenizer. (No
`from __future__ import annotations`: FastAPI and pydantic must see real types.)"""

from typing import ClassVar, Literal

from pydantic import Field

from steadyrl.services.testbeds.rest import (GROUPS, SAMPLES, Batch, GroupId, ParallelColumns, StrictBody, TextOrIds,
                                             groups_tensor)


class ArithSample(StrictBody):
    prompt: TextOrIds
    completion: TextOrIds
    group: GroupId = 0


class ArithRequest(StrictBody):
    """Prompt/completion pairs of the arith testbed (POST /v1/score of an arith app), as text ("07+45=", "52")
    or token ids of the app's tokenizer."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples",)
    kind: Literal["arith"] = "arith"
    samples: list[ArithSample] = Field(min_length=1, description=SAMPLES)

    def batch(self) -> Batch:
        s = self.samples
        return Batch([x.completion for x in s], [x.prompt for x in s], groups_tensor([x.group for x in s]))


class ArithARRequest(ArithRequest):
    """Prompt/completion pairs of the arith_ar testbed (an autoregressive LM on the arith tasks), as for arith."""

    kind: Literal["arith_ar"] = "arith_ar"


class ArithBDRequest(ArithRequest):
    """Prompt/completion pairs of the arith_bd testbed (a block-diffusion LM on the arith tasks), as for arith."""

    kind: Literal["arith_bd"] = "arith_bd"


class TextScoreRequest(ParallelColumns):
    """Deprecated (POST /score_text): prompts and completions as text or token ids."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("prompts", "completions", "group")
    prompts: list[TextOrIds] = Field(min_length=1)
    completions: list[TextOrIds] = Field(min_length=1)
    group: list[GroupId] | None = Field(None, description=GROUPS)

    def batch(self) -> Batch:
        return Batch(list(self.completions), list(self.prompts), groups_tensor(self.group))
