"""The digits testbed's REST bodies: 8x8 images in model space and the digit each was asked to show. (No
`from __future__ import annotations`: FastAPI and pydantic must see real types.)"""

from typing import Annotated, Any, ClassVar, Literal, Sequence, Union

import torch
from pydantic import Discriminator, Field, Tag

from steadyrl.rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from steadyrl.services.testbeds.rest import (GROUPS, SAMPLES, AsInt, Batch, GroupId, ParallelColumns, StrictBody,
                                             groups_tensor)

PIXEL_BOUND = 2.0  # digits pixels: model space is [-1, 1]; unclipped sampler output may overshoot a little

Pixel = Annotated[float, Field(ge=-PIXEL_BOUND, le=PIXEL_BOUND, allow_inf_nan=False)]
PixelRow = Annotated[list[Pixel], Field(min_length=IMAGE_SHAPE[2], max_length=IMAGE_SHAPE[2])]
DigitImageHW = Annotated[list[PixelRow], Field(min_length=IMAGE_SHAPE[1], max_length=IMAGE_SHAPE[1])]
DigitImageCHW = Annotated[list[DigitImageHW], Field(min_length=1, max_length=1)]


def _image_layout(value: Any) -> str:
    """'1x8x8' for a value nested three lists deep, else '8x8' (which then reports what is wrong)."""
    depth = 0
    while isinstance(value, list) and value and depth < 3:
        depth, value = depth + 1, value[0]
    return "1x8x8" if depth == 3 else "8x8"


DigitImage = Annotated[
    Union[Annotated[DigitImageHW, Tag("8x8")], Annotated[DigitImageCHW, Tag("1x8x8")]],
    Discriminator(_image_layout),
    Field(description=f"an 8x8 digit image (or 1x8x8, the tensor layout) in model space: -1 is background, 1 is "
          f"ink; values up to ±{PIXEL_BOUND:g} (unclipped sampler output) are accepted and the classifiers clamp "
          f"them to [-1, 1]"),
]


Digit = Annotated[int, Field(ge=0, le=NUM_CLASSES - 1, description="the digit this sample was asked to show"), AsInt]


def _digit_images(images: Sequence[list[Any]]) -> torch.Tensor:
    return torch.tensor([img if len(img) == 1 else [img] for img in images], dtype=torch.float32)


class DigitsSample(StrictBody):
    image: DigitImage
    digit: Digit
    group: GroupId = 0


class DigitsRequest(StrictBody):
    """Digits samples (POST /v1/score of a digits app): 8x8 images and the digit each was asked to show."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples",)
    kind: Literal["digits"] = "digits"
    samples: list[DigitsSample] = Field(min_length=1, description=SAMPLES)

    def batch(self) -> Batch:
        s = self.samples
        return Batch(_digit_images([x.image for x in s]), torch.tensor([x.digit for x in s]),
                     groups_tensor([x.group for x in s]))


class ScoreRequest(ParallelColumns):
    """Deprecated (POST /score): digits images [B,8,8] or [B,1,8,8] and one requested class per sample."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples", "cond", "group")
    samples: list[DigitImage] = Field(min_length=1)
    cond: list[Digit] = Field(min_length=1, description="requested digit per sample, 0-9")
    group: list[GroupId] | None = Field(None, description=GROUPS)

    def batch(self) -> Batch:
        return Batch(_digit_images(self.samples), torch.tensor(self.cond), groups_tensor(self.group))
