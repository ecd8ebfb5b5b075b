"""The REST vocabulary every testbed's request model is written in: strict bodies, the element types they share
(text, token ids, group ids), the columns check of pre-v1 bodies, and `RestProfile`, what a testbed's reward app
accepts. (No `from __future__ import annotations` here: FastAPI and pydantic must see real types.)
"""

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Sequence, Union

import torch
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag, model_validator

MAX_TEXT_CHARS = 4096  # per prompt / completion
MAX_TOKENS = 4096  # per prompt / completion given as token ids
MAX_TOKEN_ID = 2**31 - 1  # ids past the tokenizer's vocabulary decode as unknown; this bound keeps them ints
INT32 = 2**31  # group ids: exact as JSON floats too (2**63 - 1 is not: 9.223372036854776e18 rounds up)

# ----------------------------------------------------------------------------------- element types

def _integral(value: Any) -> Any:
    """JSON Schema's integers include 8.0: take an integral float as the int (strict models refuse it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


AsInt = BeforeValidator(_integral)  # otherwise strict: no "3", no true (after the Field: its schema stays)
GroupId = Annotated[int, Field(ge=-INT32, le=INT32 - 1, description="group id (e.g. the prompt's index): "
                               "ranks for the uncertainty are taken within a group; omitted: one group"), AsInt]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]


def _non_negative(token_id: int) -> int:
    if token_id < 0:
        raise ValueError("token ids must be >= 0")
    return token_id


TokenId = Annotated[int, Field(le=MAX_TOKEN_ID, json_schema_extra={"minimum": 0}), AsInt, AfterValidator(_non_negative)]
TokenIds = Annotated[list[TokenId], Field(max_length=MAX_TOKENS)]
TextOrIds = Annotated[
    Union[Annotated[Text, Tag("text")], Annotated[TokenIds, Tag("token_ids")]],
    Discriminator(lambda v: "token_ids" if isinstance(v, list) else "text"),
    Field(description=f"text (at most {MAX_TEXT_CHARS} characters), or token ids of the app's tokenizer (at most "
          f"{MAX_TOKENS}; a completion's ids are read up to <eos>); any text is scored, malformed output scores 0"),
]

@dataclass
class Batch:
    """A validated request, ready to score: digits and text-to-image as tensors, arith as items."""

    samples: torch.Tensor | list[Any]  # images [B,C,H,W] in model space, or completions (text / ids)
    cond: torch.Tensor | list[Any]  # class ids [B], prompt strings, or prompts (text / ids)
    group: torch.Tensor | None  # [B] long


def groups_tensor(groups: Sequence[int] | None) -> torch.Tensor | None:
    return None if groups is None else torch.tensor(list(groups), dtype=torch.long)


class StrictBody(BaseModel):
    """JSON types as written (no "3" for 3), no unknown keys."""

    model_config = ConfigDict(extra="forbid", strict=True)


SAMPLES = "one record per sample"


class ParallelColumns(StrictBody):
    """A pre-v1 body: parallel arrays (`COLUMNS`), one entry per sample, whose lengths must agree (the one
    check every such body shares; v1 records cannot disagree)."""

    COLUMNS: ClassVar[tuple[str, ...]]

    @model_validator(mode="after")
    def _lengths_agree(self) -> "ParallelColumns":
        first, *rest = self.COLUMNS
        n = len(getattr(self, first))
        for name in rest:
            column = getattr(self, name)
            if column is not None and len(column) != n:
                raise ValueError(f"{name} has {len(column)} entries but {first} has {n}")
        return self


GROUPS = "group id per sample (ranks are taken within a group)"


@dataclass(frozen=True)
class RestProfile:
    """What a testbed's reward app accepts over REST (each testbed supplies its own, `Testbed.rest`): its v1
    request model (a `StrictBody` with `COLUMNS` and `batch()`), whether its samples are scored as prompt /
    completion items by verifiers (else as tensors with their conditioning), and its deprecated pre-v1 route
    and body, if it has one."""

    testbed: str
    request: type[StrictBody]
    items: bool = False
    legacy_route: str | None = None
    legacy_request: type[StrictBody] | None = None
