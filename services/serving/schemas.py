"""The REST contract of the reward app: routes, request and response bodies. (No `from __future__ import
annotations` here: FastAPI and pydantic must see real types.)

REST, under the route prefix (default /reward):
    POST /v1/score   the app's testbed's samples, one record each, tagged by `kind`:
                       digits         {"image": 8x8 (or 1x8x8) floats in [-2, 2], "digit": 0-9}
                       arith          {"prompt": text or token ids, "completion": text or token ids}
                       text_to_image  {"image": base64 PNG, "prompt": text}   (one image size per request)
                     each with an optional "group" (ranks are taken within a group)
    GET  /v1/models  the reward models: name, kind, ensemble member or monitor, trained on or not
    GET  /healthz    every model answers; open even when a token is required (probes carry no secrets)
    POST /score, /score_text, /score_images   deprecated pre-v1 bodies (parallel arrays), not in the OpenAPI

`serve.max_request_samples` caps the samples per request (`with_max_samples`: a 422 naming `samples` and the
limit). A 422 names the field and never echoes the input (`errors.validation_error`).
"""

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Sequence, TypeVar, Union

import torch
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PlainValidator, Tag,
                      WithJsonSchema, create_model, model_validator)

from steadyrl.rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from steadyrl.services.serving.png import MAX_IMAGE_SIDE, check_one_size, decode_png, rgb_images

SCORE_ROUTE, MODELS_ROUTE, HEALTH_ROUTE = "/v1/score", "/v1/models", "/healthz"
# the deprecated pre-v1 routes (a fixed set: testbeds added since have /v1/score only); an app answers the others' 400
LEGACY_ROUTES = {"digits": "/score", "arith": "/score_text", "text_to_image": "/score_images"}
PIXEL_BOUND = 2.0  # digits pixels: model space is [-1, 1]; unclipped sampler output may overshoot a little
MAX_TEXT_CHARS = 4096  # per prompt / completion
MAX_TOKENS = 4096  # per prompt / completion given as token ids
MAX_TOKEN_ID = 2**31 - 1  # ids past the tokenizer's vocabulary decode as unknown; this bound keeps them ints
MAX_REPORTED_ERRORS = 20  # a 422 lists at most this many field errors (a bad 256-image batch has 16k)
INT32 = 2**31  # group ids: exact as JSON floats too (2**63 - 1 is not: 9.223372036854776e18 rounds up)

# ----------------------------------------------------------------------------------- element types

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


def _integral(value: Any) -> Any:
    """JSON Schema's integers include 8.0: take an integral float as the int (strict models refuse it)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


AsInt = BeforeValidator(_integral)  # otherwise strict: no "3", no true (after the Field: its schema stays)
Digit = Annotated[int, Field(ge=0, le=NUM_CLASSES - 1, description="the digit this sample was asked to show"), AsInt]
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
PngImage = Annotated[
    Any,  # validated: the decoded RGB uint8 pixels [H,W,3]
    PlainValidator(decode_png),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "contentMediaType": "image/png",
                    "description": f"a base64-encoded PNG (RGB, grey or palette; alpha is dropped; a data: URL "
                    f"works too); each side at most {MAX_IMAGE_SIDE} px. Pixels p in 0..255 are scored in model "
                    f"space as p / 127.5 - 1"}),
]

# ------------------------------------------------------------------------------------ request models


@dataclass
class Batch:
    """A validated request, ready to score: digits and text-to-image as tensors, arith as items."""

    samples: torch.Tensor | list[Any]  # images [B,C,H,W] in model space, or completions (text / ids)
    cond: torch.Tensor | list[Any]  # class ids [B], prompt strings, or prompts (text / ids)
    group: torch.Tensor | None  # [B] long


def _groups(groups: Sequence[int] | None) -> torch.Tensor | None:
    return None if groups is None else torch.tensor(list(groups), dtype=torch.long)


def _digit_images(images: Sequence[list[Any]]) -> torch.Tensor:
    return torch.tensor([img if len(img) == 1 else [img] for img in images], dtype=torch.float32)


class StrictBody(BaseModel):
    """JSON types as written (no "3" for 3), no unknown keys."""

    model_config = ConfigDict(extra="forbid", strict=True)


class DigitsSample(StrictBody):
    image: DigitImage
    digit: Digit
    group: GroupId = 0


class ArithSample(StrictBody):
    prompt: TextOrIds
    completion: TextOrIds
    group: GroupId = 0


class TextToImageSample(StrictBody):
    image: PngImage
    prompt: Text = Field(description="the prompt the image was generated from")
    group: GroupId = 0


_SAMPLES = "one record per sample"


class DigitsRequest(StrictBody):
    """Digits samples (POST /v1/score of a digits app): 8x8 images and the digit each was asked to show."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples",)
    kind: Literal["digits"] = "digits"
    samples: list[DigitsSample] = Field(min_length=1, description=_SAMPLES)

    def batch(self) -> Batch:
        s = self.samples
        return Batch(_digit_images([x.image for x in s]), torch.tensor([x.digit for x in s]),
                     _groups([x.group for x in s]))


class ArithRequest(StrictBody):
    """Prompt/completion pairs of the arith testbed (POST /v1/score of an arith app), as text ("07+45=", "52")
    or token ids of the app's tokenizer."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples",)
    kind: Literal["arith"] = "arith"
    samples: list[ArithSample] = Field(min_length=1, description=_SAMPLES)

    def batch(self) -> Batch:
        s = self.samples
        return Batch([x.completion for x in s], [x.prompt for x in s], _groups([x.group for x in s]))


class ArithARRequest(ArithRequest):
    """Prompt/completion pairs of the arith_ar testbed (an autoregressive LM on the arith tasks), as for arith."""

    kind: Literal["arith_ar"] = "arith_ar"


class ArithBDRequest(ArithRequest):
    """Prompt/completion pairs of the arith_bd testbed (a block-diffusion LM on the arith tasks), as for arith."""

    kind: Literal["arith_bd"] = "arith_bd"


class TextToImageRequest(StrictBody):
    """Text-to-image samples (POST /v1/score of a text-to-image app): PNGs, all of one size, and their prompts,
    scored as images [B,3,H,W] in [-1, 1]."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples",)
    kind: Literal["text_to_image"] = "text_to_image"
    samples: list[TextToImageSample] = Field(min_length=1, description=_SAMPLES + "; all images of one size")

    @model_validator(mode="after")
    def _one_size(self) -> "TextToImageRequest":
        check_one_size([x.image for x in self.samples], "samples.image")
        return self

    def batch(self) -> Batch:
        s = self.samples
        return Batch(rgb_images([x.image for x in s]), [x.prompt for x in s], _groups([x.group for x in s]))


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


_GROUPS = "group id per sample (ranks are taken within a group)"


class ScoreRequest(ParallelColumns):
    """Deprecated (POST /score): digits images [B,8,8] or [B,1,8,8] and one requested class per sample."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples", "cond", "group")
    samples: list[DigitImage] = Field(min_length=1)
    cond: list[Digit] = Field(min_length=1, description="requested digit per sample, 0-9")
    group: list[GroupId] | None = Field(None, description=_GROUPS)

    def batch(self) -> Batch:
        return Batch(_digit_images(self.samples), torch.tensor(self.cond), _groups(self.group))


class TextScoreRequest(ParallelColumns):
    """Deprecated (POST /score_text): prompts and completions as text or token ids."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("prompts", "completions", "group")
    prompts: list[TextOrIds] = Field(min_length=1)
    completions: list[TextOrIds] = Field(min_length=1)
    group: list[GroupId] | None = Field(None, description=_GROUPS)

    def batch(self) -> Batch:
        return Batch(list(self.completions), list(self.prompts), _groups(self.group))


class ImageScoreRequest(ParallelColumns):
    """Deprecated (POST /score_images): base64 PNGs, all of one size, and their prompts."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("images", "prompts", "group")
    images: list[PngImage] = Field(min_length=1)
    prompts: list[Text] = Field(min_length=1)
    group: list[GroupId] | None = Field(None, description=_GROUPS)

    @model_validator(mode="after")
    def _one_size(self) -> "ImageScoreRequest":
        check_one_size(self.images, "images")
        return self

    def batch(self) -> Batch:
        return Batch(rgb_images(self.images), list(self.prompts), _groups(self.group))


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


AnyScoreRequest = Annotated[Union[DigitsRequest, ArithRequest, ArithARRequest, ArithBDRequest,
                                  TextToImageRequest],
                            Field(discriminator="kind")]
"""The v1 body of any testbed, tagged by `kind` (each app accepts, and publishes, its own testbed's)."""

M = TypeVar("M", bound=StrictBody)


def with_max_samples(model: type[M], max_samples: int) -> type[M]:
    """`model` whose per-sample columns hold at most `max_samples` entries (in its OpenAPI too: maxItems)."""
    fields: dict[str, Any] = {}
    for name in model.COLUMNS:
        info = model.model_fields[name]
        fields[name] = (info.annotation, Field(info.default, min_length=1, max_length=max_samples,
                                               description=info.description))
    return create_model(model.__name__, __base__=model, __doc__=model.__doc__, __module__=model.__module__,
                        **fields)


# ----------------------------------------------------------------------------------- response models


class ScoreResponse(BaseModel):
    names: list[str] = Field(description="ensemble members, the columns of `scores`")
    scores: list[list[float]] = Field(description="[B][K] per-model scores")
    mean: list[float]
    std: list[float]
    uncertainty: list[float] = Field(description="rank disagreement between members, per sample")
    reward: list[float] = Field(description="the training reward")
    train_on: str
    monitors: dict[str, list[float]] = Field(description="watch-only models (gold, monitor-only), never trained "
                                             "on; `<name>_correct` is a classifier/verifier monitor's 0/1 verdict")


class ModelInfo(BaseModel):
    name: str
    kind: str = Field(description="classifier, jpeg, verifier, clip_score, aesthetic or preference")
    role: Literal["member", "monitor"] = Field(description="member: in the ensemble (its scores, mean, spread, "
                                               "uncertainty); monitor: scored and reported, never part of the reward")
    trained_on: bool = Field(description="whether the training reward comes from this model (`train_on`: one "
                             "member, every member when it is 'mean', the members weighted > 0 when 'weighted')")
    test_accuracy: float | None = Field(None, description="held-out accuracy of a classifier, else null")


_TESTBED = "the testbed whose samples this app scores (digits, arith, text_to_image, ...)"


class ModelsResponse(BaseModel):
    testbed: str = Field(description=_TESTBED)
    train_on: str = Field(description="the member the training reward is, 'mean' of the members, or 'weighted' "
                          "(their weighted sum)")
    feature_model: str | None = Field(description="the member whose features measure diversity (handle only)")
    models: list[ModelInfo]


class HealthResponse(BaseModel):
    status: Literal["ok"]
    testbed: str = Field(description=_TESTBED)
    route: str = Field(description="where this app scores samples")
    members: list[str]
    monitors: list[str]
    gold: str | None
    train_on: str
    feature_model: str | None
    models: list[dict[str, Any]] = Field(description="what each model's replica reports (name, kind, accuracy)")


class ErrorDetail(BaseModel):
    detail: str


class ValidationErrorItem(BaseModel):
    loc: list[str | int] = Field(description="where: 'body', then the field path")
    msg: str
    type: str


class ValidationErrorResponse(BaseModel):
    detail: list[ValidationErrorItem] = Field(description=f"the first {MAX_REPORTED_ERRORS} errors (the input "
                                              "is never echoed)")
