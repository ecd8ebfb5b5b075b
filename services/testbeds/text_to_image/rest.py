"""The text-to-image testbed's REST bodies: base64 PNGs (all of one size per request) and their prompts. (No
`from __future__ import annotations`: FastAPI and pydantic must see real types.)"""

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, PlainValidator, WithJsonSchema, model_validator

from steadyrl.services.testbeds.png import MAX_IMAGE_SIDE, check_one_size, decode_png, rgb_images
from steadyrl.services.testbeds.rest import (GROUPS, SAMPLES, Batch, GroupId, ParallelColumns, StrictBody, Text,
                                             groups_tensor)

PngImage = Annotated[
    Any,  # validated: the decoded RGB uint8 pixels [H,W,3]
    PlainValidator(decode_png),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "contentMediaType": "image/png",
                    "description": f"a base64-encoded PNG (RGB, grey or palette; alpha is dropped; a data: URL "
                    f"works too); each side at most {MAX_IMAGE_SIDE} px. Pixels p in 0..255 are scored in model "
                    f"space as p / 127.5 - 1"}),
]


class TextToImageSample(StrictBody):
    image: PngImage
    prompt: Text = Field(description="the prompt the image was generated from")
    group: GroupId = 0


class TextToImageRequest(StrictBody):
    """Text-to-image samples (POST /v1/score of a text-to-image app): PNGs, all of one size, and their prompts,
    scored as images [B,3,H,W] in [-1, 1]."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples",)
    kind: Literal["text_to_image"] = "text_to_image"
    samples: list[TextToImageSample] = Field(min_length=1, description=SAMPLES + "; all images of one size")

    @model_validator(mode="after")
    def _one_size(self) -> "TextToImageRequest":
        check_one_size([x.image for x in self.samples], "samples.image")
        return self

    def batch(self) -> Batch:
        s = self.samples
        return Batch(rgb_images([x.image for x in s]), [x.prompt for x in s], groups_tensor([x.group for x in s]))


class ImageScoreRequest(ParallelColumns):
    """Deprecated (POST /score_images): base64 PNGs, all of one size, and their prompts."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("images", "prompts", "group")
    images: list[PngImage] = Field(min_length=1)
    prompts: list[Text] = Field(min_length=1)
    group: list[GroupId] | None = Field(None, description=GROUPS)

    @model_validator(mode="after")
    def _one_size(self) -> "ImageScoreRequest":
        check_one_size(self.images, "images")
        return self

    def batch(self) -> Batch:
        return Batch(rgb_images(self.images), list(self.prompts), groups_tensor(self.group))
