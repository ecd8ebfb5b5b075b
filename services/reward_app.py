"""The reward ensemble as a Ray Serve application.

One deployment per reward model (`@serve.batch` groups concurrent calls into one forward pass unless
`serve.batching` is off), composed by an ingress deployment that returns per-model scores, mean, spread, the
training reward and a rank-disagreement uncertainty per sample (`reward.ensemble.combine_scores`). Training
calls it through a DeploymentHandle (`score_tensors`); anything else over REST. The ingress builds its FastAPI
app on each replica (`__serve_build_asgi_app__`) for its testbed and `ServeConfig` limits, so the OpenAPI it
publishes (/openapi.json, /docs) states exactly what that app accepts. (No `from __future__ import
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

Limits: `serve.max_request_samples` (422 naming `samples` and the limit), `serve.max_body_bytes` (413, from
Content-Length or while the body streams in, before any JSON is parsed), an optional bearer token
(`serve.auth_token_env` / `serve.auth_token_file`: 401 without it; only its SHA-256 reaches the replicas).
A 422 names the field and never echoes the input (a NaN could not be encoded; a huge body should not return).
"""

import asyncio
import base64
import binascii
import hashlib
import hmac
import io
import json
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Sequence, TypeVar, Union

import numpy as np
import torch
from fastapi import FastAPI, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPBearer
from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, PlainValidator, Tag,
                      WithJsonSchema, create_model, model_validator)
from ray import serve
from ray.serve.handle import DeploymentHandle

from steadyrl.reward.base import check_scores
from steadyrl.reward.config import FEATURE_KINDS, ImageRewardConfig, RewardConfig
from steadyrl.reward.ensemble import EnsembleScores, combine_scores
from steadyrl.reward.factory import build_reward_model, parse_reward_spec
from steadyrl.reward.verifiers import VerifierReward, VerifierSpec
from steadyrl.rollout.digits import IMAGE_SHAPE, NUM_CLASSES
from steadyrl.services.config import ServeConfig

APP_NAME = "reward"
ROUTE_PREFIX = "/reward"
SCORE_ROUTE, MODELS_ROUTE, HEALTH_ROUTE = "/v1/score", "/v1/models", "/healthz"
LEGACY_ROUTES = {"digits": "/score", "arith": "/score_text", "text_to_image": "/score_images"}  # deprecated
TESTBEDS = tuple(LEGACY_ROUTES)
OPEN_PATHS = frozenset({HEALTH_ROUTE, "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
PIXEL_BOUND = 2.0  # digits pixels: model space is [-1, 1]; unclipped sampler output may overshoot a little
MAX_IMAGE_SIDE = 2048  # PNG sides above this are refused from the header, before the pixels are decoded
MAX_TEXT_CHARS = 4096  # per prompt / completion
MAX_TOKENS = 4096  # per prompt / completion given as token ids
MAX_TOKEN_ID = 2**31 - 1  # ids past the tokenizer's vocabulary decode as unknown; this bound keeps them ints
MAX_REPORTED_ERRORS = 20  # a 422 lists at most this many field errors (a bad 256-image batch has 16k)
HEALTH_PROMPT = "health check"
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


def decode_png(data: Any) -> np.ndarray:
    """A base64 PNG (optionally a `data:image/png;base64,` URL) as RGB uint8 pixels [H,W,3]; grey and
    palette images are converted to RGB, an alpha channel is dropped. Sides above MAX_IMAGE_SIDE are refused
    from the header, before the pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    if not isinstance(data, str):
        raise ValueError(f"expected a base64 PNG string, got {type(data).__name__}")
    if data.startswith("data:"):
        head, _, data = data.partition(",")
        if not head.endswith(";base64"):
            raise ValueError("a data URL must be base64-encoded (data:image/png;base64,...)")
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"not valid base64 ({err})") from err
    try:
        img = Image.open(io.BytesIO(raw), formats=["PNG"])
        w, h = img.size
        if max(w, h) > MAX_IMAGE_SIDE or min(w, h) < 1:
            raise ValueError(f"image is {w}x{h}; each side must be between 1 and {MAX_IMAGE_SIDE} pixels")
        pixels = np.array(img.convert("RGB"), dtype=np.uint8)  # writable (torch.from_numpy)
    except ValueError:
        raise
    except UnidentifiedImageError as err:
        raise ValueError(f"not a PNG image ({len(raw)} bytes that PIL does not read as PNG)") from err
    except Exception as err:  # PIL raises several types for data that is not a (whole) PNG
        raise ValueError(f"not a decodable PNG image ({type(err).__name__}: {err})") from err
    return pixels


def encode_png(pixels: np.ndarray | torch.Tensor) -> str:
    """RGB uint8 pixels [H,W,3] (or a model-space image [3,H,W] in [-1, 1]) as a base64 PNG string."""
    from PIL import Image

    if isinstance(pixels, torch.Tensor):
        pixels = ((pixels.detach().float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        pixels = pixels.permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(pixels, dtype=np.uint8)).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


PngImage = Annotated[
    Any,  # validated: the decoded RGB uint8 pixels [H,W,3]
    PlainValidator(decode_png),
    WithJsonSchema({"type": "string", "contentEncoding": "base64", "contentMediaType": "image/png",
                    "description": f"a base64-encoded PNG (RGB, grey or palette; alpha is dropped; a data: URL "
                    f"works too); each side at most {MAX_IMAGE_SIDE} px. Pixels p in 0..255 are scored in model "
                    f"space as p / 127.5 - 1"}),
]


def _one_size(images: Sequence[np.ndarray], field: str) -> None:
    sizes = sorted({f"{a.shape[1]}x{a.shape[0]}" for a in images})
    if len(sizes) > 1:
        raise ValueError(f"{field}: all images in one request must have the same size (WxH), got {sizes}")


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


def _rgb_images(images: Sequence[np.ndarray]) -> torch.Tensor:
    """Pixels [H,W,3] uint8 -> model space [B,3,H,W] float32 in [-1, 1]."""
    return (torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2).float() / 127.5 - 1).contiguous()


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


class TextToImageRequest(StrictBody):
    """Text-to-image samples (POST /v1/score of a text-to-image app): PNGs, all of one size, and their prompts,
    scored as images [B,3,H,W] in [-1, 1]."""

    COLUMNS: ClassVar[tuple[str, ...]] = ("samples",)
    kind: Literal["text_to_image"] = "text_to_image"
    samples: list[TextToImageSample] = Field(min_length=1, description=_SAMPLES + "; all images of one size")

    @model_validator(mode="after")
    def _one_size(self) -> "TextToImageRequest":
        _one_size([x.image for x in self.samples], "samples.image")
        return self

    def batch(self) -> Batch:
        s = self.samples
        return Batch(_rgb_images([x.image for x in s]), [x.prompt for x in s], _groups([x.group for x in s]))


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
        _one_size(self.images, "images")
        return self

    def batch(self) -> Batch:
        return Batch(_rgb_images(self.images), list(self.prompts), _groups(self.group))


V1_REQUESTS: dict[str, type[StrictBody]] = {"digits": DigitsRequest, "arith": ArithRequest,
                                             "text_to_image": TextToImageRequest}
LEGACY_REQUESTS: dict[str, type[StrictBody]] = {"digits": ScoreRequest, "arith": TextScoreRequest,
                                                 "text_to_image": ImageScoreRequest}
AnyScoreRequest = Annotated[Union[DigitsRequest, ArithRequest, TextToImageRequest], Field(discriminator="kind")]
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
                             "member, or every member when it is 'mean')")
    test_accuracy: float | None = Field(None, description="held-out accuracy of a classifier, else null")


class ModelsResponse(BaseModel):
    testbed: Literal["digits", "arith", "text_to_image"]
    train_on: str = Field(description="the member the training reward is, or 'mean' of the members")
    feature_model: str | None = Field(description="the member whose features measure diversity (handle only)")
    models: list[ModelInfo]


class HealthResponse(BaseModel):
    status: Literal["ok"]
    testbed: Literal["digits", "arith", "text_to_image"]
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


# --------------------------------------------------------------------------- REST guard and errors


def token_digest(token: str) -> str:
    """SHA-256 hex of a bearer token: what the replicas hold and compare against."""
    return hashlib.sha256(token.encode()).hexdigest()


async def _reply(send: Any, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class RestGuard:
    """ASGI middleware in front of every route: the bearer token (401; OPEN_PATHS need none), then the body
    size (413, from Content-Length or counted while the body streams in), both before any JSON is parsed."""

    def __init__(self, app: Any, max_body_bytes: int, token_sha256: str | None = None):
        self.app, self.max_body_bytes, self.token_sha256 = app, max_body_bytes, token_sha256

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token_digest(token.strip()), self.token_sha256)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path
        headers = dict(scope["headers"])
        if self.token_sha256 is not None and path not in OPEN_PATHS and not self._authorized(headers):
            return await _reply(send, 401, "missing or wrong bearer token: send `Authorization: Bearer <token>`",
                                [(b"www-authenticate", b"Bearer")])
        limit = f"the request body limit is {self.max_body_bytes} bytes (serve.max_body_bytes)"
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _reply(send, 400, "Content-Length is not a number")
            if int(length) > self.max_body_bytes:
                return await _reply(send, 413, f"body of {int(length)} bytes: {limit}")
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _reply(send, 413, f"body over {self.max_body_bytes} bytes: {limit}")
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for a disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field (`loc`), without the input: pydantic's default echoes it, and a NaN from JSON's
    non-standard literal cannot be encoded back (it was a 500), a 20,000-sample body should not return."""
    errors = exc.errors()
    detail = [{"loc": [p if isinstance(p, (str, int)) else str(p) for p in e["loc"]], "msg": str(e["msg"]),
               "type": str(e["type"])} for e in errors[:MAX_REPORTED_ERRORS]]
    if len(errors) > MAX_REPORTED_ERRORS:
        detail.append({"loc": ["body"], "msg": f"... and {len(errors) - MAX_REPORTED_ERRORS} more errors",
                       "type": "too_many_errors"})
    return JSONResponse(status_code=422, content={"detail": detail})


# ------------------------------------------------------------------------------------- deployments


def _is_prompts(cond: Any) -> bool:
    return isinstance(cond, (list, tuple)) and all(isinstance(c, str) for c in cond)


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, health_check_period_s=10)
class RewardModelDeployment:
    """Hosts one reward model; batches concurrent `score` calls into one forward pass (unless `batching` is
    off: then each call is scored on its own)."""

    def __init__(self, spec: dict[str, Any], max_batch_size: int = 256, batch_wait_timeout_s: float = 0.005,
                 batching: bool = True):
        torch.set_num_threads(1)
        parsed = parse_reward_spec(spec)
        self.kind = parsed.kind
        self.model = build_reward_model(parsed)  # the same factory as the in-process ensemble
        self.name = self.model.name
        self.batching = batching
        self._score_batch.set_max_batch_size(max_batch_size)
        self._score_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    async def score(self, samples: torch.Tensor, cond: torch.Tensor | Sequence[str]) -> torch.Tensor:
        """Scores [B] of one call: `cond` is class ids / prompt token ids [B,...] or a list of B prompt strings.
        Checked per call (an error fails only this call), then batched with concurrent calls."""
        n = len(cond)
        if n != samples.shape[0]:
            raise ValueError(f"reward model {self.name!r}: cond has {n} entries for {samples.shape[0]} samples")
        cond = list(cond) if _is_prompts(cond) else cond
        if not self.batching:
            return check_scores(self.name, self.model.score(samples, cond), n)
        return await self._score_batch(samples, cond)

    @serve.batch(max_batch_size=256, batch_wait_timeout_s=0.005)
    async def _score_batch(self, samples: list[torch.Tensor], cond: list[Any]) -> list[torch.Tensor]:
        """One forward pass over the calls when their samples share a shape and their conds join: prompt lists
        by concatenation, tensors (same width) by torch.cat. Otherwise (other image sizes, prompts padded to
        other widths) each call is scored on its own."""
        sizes = [s.shape[0] for s in samples]
        same = len({(tuple(s.shape[1:]), s.dtype) for s in samples}) == 1
        if same and all(_is_prompts(c) for c in cond):
            out = self.model.score(torch.cat(samples), [p for c in cond for p in c])
        elif same and all(isinstance(c, torch.Tensor) for c in cond) and len({c.shape[1:] for c in cond}) == 1:
            out = self.model.score(torch.cat(samples), torch.cat(cond))
        else:
            return [check_scores(self.name, self.model.score(s, c), n) for s, c, n in zip(samples, cond, sizes)]
        return list(check_scores(self.name, out, sum(sizes)).split(sizes))

    async def score_items(self, prompts: list[Any], completions: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Verifiers: (scores, exact 0/1) of text or token-id items (REST, arith)."""
        if not isinstance(self.model, VerifierReward):
            raise ValueError(f"reward model {self.name!r} scores images, not text")
        return self.model.score_items(prompts, completions)

    async def correct(self, samples: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        return self.model.correct(samples, cond)

    async def features(self, samples: torch.Tensor) -> torch.Tensor:
        return self.model.features(samples)

    def info(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "test_accuracy": getattr(self.model, "accuracy", None)}

    def check_health(self) -> None:
        """Serve calls this periodically; a broken model raises and the replica is replaced."""
        if isinstance(self.model, VerifierReward):
            return  # a pure function of text: nothing to go stale
        if self.kind in FEATURE_KINDS:  # image-text (CLIP) models: one grey RGB image and a prompt
            out = self.model.score(torch.zeros(1, 3, 32, 32), [HEALTH_PROMPT])
        else:  # digits classifiers, JPEG
            out = self.model.score(torch.zeros(1, *IMAGE_SHAPE), torch.zeros(1, dtype=torch.long))
        if not bool(torch.isfinite(out).all()):
            raise RuntimeError(f"reward model {self.name} returns non-finite scores")


@dataclass(frozen=True)
class RestSettings:
    """What the ingress's REST app needs from `ServeConfig` (the token only as its SHA-256)."""

    max_samples: int = 256
    max_body_bytes: int = 16 * 2**20
    token_sha256: str | None = None

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> "RestSettings":
        token = cfg.auth_token()
        return cls(cfg.max_request_samples, cfg.max_body_bytes, None if token is None else token_digest(token))


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, health_check_period_s=10)
@serve.ingress()
class RewardEnsembleIngress:
    """Composes member deployments; monitors (digits' gold classifier, arith's exact-match verifier, the
    text-to-image `monitor_only` models) are scored too but never become the reward."""

    def __init__(self, members: list[DeploymentHandle], member_names: list[str], monitors: list[DeploymentHandle],
                 monitor_names: list[str], train_on: str, feature_model: str | None = None, testbed: str = "digits",
                 correct: Sequence[str] = (), rest: RestSettings | None = None, digest: str = ""):
        """`feature_model`: a member whose `features` come back with `score_tensors` (None: no features);
        `correct`: monitors that also report `<name>_correct` (digits' gold classifier, arith's exact verifier);
        `rest`: the REST API's limits and token digest; `digest`: what the app was built from (`app_digest`)."""
        if testbed not in TESTBEDS:
            raise ValueError(f"testbed={testbed!r} must be one of {list(TESTBEDS)}")
        if feature_model is not None and feature_model not in member_names:
            raise ValueError(f"feature_model={feature_model!r} must be one of the members {member_names}")
        self.testbed = testbed
        self.members, self.member_names = members, list(member_names)
        self.monitors, self.monitor_names = monitors, list(monitor_names)
        self.correct = set(correct)
        self.train_on, self.feature_model = train_on, feature_model
        self.rest = rest or RestSettings()
        self.digest = digest

    def app_digest(self) -> str:
        """The digest of the models and settings this app was built from: a run finding the same one reuses it."""
        return self.digest

    def __serve_build_asgi_app__(self) -> FastAPI:
        """Serve calls this on each replica, after __init__: the REST app of this testbed and these limits."""
        return build_rest_api(self)

    async def score_tensors(self, samples: torch.Tensor, cond: torch.Tensor | Sequence[str],
                            group: torch.Tensor | Sequence[int] | None = None,
                            with_features: bool = True) -> EnsembleScores:
        """In-cluster entry point (DeploymentHandle): samples [B,...] with class ids [B] (digits) or B prompt
        strings (text-to-image images [B,3,H,W] in [-1, 1]); `EnsembleScores` out."""
        if len(cond) != samples.shape[0]:
            raise ValueError(f"cond has {len(cond)} entries for {samples.shape[0]} samples")
        if not isinstance(cond, torch.Tensor):
            if not _is_prompts(cond):
                raise ValueError("cond must be a tensor of class ids or a list of prompt strings")
            cond = list(cond)
        if group is not None and not isinstance(group, torch.Tensor):
            group = torch.as_tensor(list(group), dtype=torch.long)
        calls = [m.score.remote(samples, cond) for m in self.members]
        mon = [(name, m.score.remote(samples, cond), m.correct.remote(samples, cond) if name in self.correct
                else None) for name, m in zip(self.monitor_names, self.monitors)]
        feat = None
        if with_features and self.feature_model is not None:
            feat = self.members[self.member_names.index(self.feature_model)].features.remote(samples)
        cols = await asyncio.gather(*calls)
        out = combine_scores(self.member_names, torch.stack(cols, dim=1), group, self.train_on)
        for name, score, correct in mon:
            out.monitors[name] = await score
            if correct is not None:
                out.monitors[f"{name}_correct"] = await correct
        out.features = None if feat is None else await feat
        return out

    async def score_items(self, prompts: list[Any], completions: list[Any],
                          group: torch.Tensor | None = None) -> EnsembleScores:
        """Verifier apps (arith): text or token-id prompt/completion pairs."""
        cols = await asyncio.gather(*[m.score_items.remote(prompts, completions) for m in self.members])
        mons = await asyncio.gather(*[m.score_items.remote(prompts, completions) for m in self.monitors])
        out = combine_scores(self.member_names, torch.stack([col[0] for col in cols], dim=1), group, self.train_on)
        for name, (score, correct) in zip(self.monitor_names, mons):
            out.monitors[name] = score
            out.monitors[f"{name}_correct"] = correct
        return out

    async def score_request(self, batch: Batch) -> ScoreResponse:
        if self.testbed == "arith":
            out = await self.score_items(batch.cond, batch.samples, batch.group)
        else:
            out = await self.score_tensors(batch.samples, batch.cond, batch.group, with_features=False)
        return ScoreResponse(
            names=out.names, scores=out.scores.tolist(), mean=out.mean.tolist(), std=out.std.tolist(),
            uncertainty=out.uncertainty.tolist(), reward=out.reward.tolist(), train_on=out.train_on,
            monitors={k: v.tolist() for k, v in out.monitors.items()},
        )

    async def model_infos(self) -> list[dict[str, Any]]:
        return await asyncio.gather(*[m.info.remote() for m in self.members + self.monitors])

    async def models(self) -> ModelsResponse:
        infos = await self.model_infos()
        roles = ["member"] * len(self.members) + ["monitor"] * len(self.monitors)
        return ModelsResponse(testbed=self.testbed, train_on=self.train_on, feature_model=self.feature_model, models=[
            ModelInfo(name=i["name"], kind=i["kind"], role=role, test_accuracy=i.get("test_accuracy"),
                      trained_on=role == "member" and self.train_on in ("mean", i["name"]))
            for i, role in zip(infos, roles)])

    async def health(self) -> HealthResponse:
        return HealthResponse(status="ok", testbed=self.testbed, route=SCORE_ROUTE, members=self.member_names,
                              monitors=self.monitor_names, gold=self.monitor_names[0] if self.monitor_names else None,
                              train_on=self.train_on, feature_model=self.feature_model, models=await self.model_infos())


def build_rest_api(ens: RewardEnsembleIngress) -> FastAPI:
    """The ingress's FastAPI app: /v1/score with its testbed's request model and `max_samples`, /v1/models,
    /healthz, the deprecated pre-v1 routes, behind `RestGuard` (token, body size) and 422s that name fields."""
    rest, testbed = ens.rest, ens.testbed
    request_model = with_max_samples(V1_REQUESTS[testbed], rest.max_samples)
    legacy_model = with_max_samples(LEGACY_REQUESTS[testbed], rest.max_samples)
    auth = rest.token_sha256 is not None
    api = FastAPI(
        title="steadyrl reward ensemble", version="1",
        description=f"Scores {testbed} samples with every reward model: per-model scores, mean, spread, training "
        f"reward and rank-disagreement uncertainty per sample, and the monitors' scores. POST {SCORE_ROUTE}: at "
        f"most {rest.max_samples} samples and {rest.max_body_bytes} bytes per request (413 before parsing when "
        "larger). " + ("Every route but /healthz and the docs needs `Authorization: Bearer <token>`." if auth else
                       "No token is needed (serve.auth_token_env / auth_token_file turn one on)."))
    api.add_exception_handler(RequestValidationError, validation_error)
    api.add_middleware(RestGuard, max_body_bytes=rest.max_body_bytes, token_sha256=rest.token_sha256)
    errors: dict[int | str, dict[str, Any]] = {
        413: {"model": ErrorDetail, "description": "body over serve.max_body_bytes (refused before parsing)"},
        422: {"model": ValidationErrorResponse, "description": "a field is missing, malformed or out of range; "
              "`loc` names it"},
        400: {"model": ErrorDetail, "description": "the body cannot be read as JSON numbers (e.g. a number over "
              "4300 digits)"}}
    secured: dict[str, Any] = {}
    if auth:
        errors[401] = {"model": ErrorDetail, "description": "no bearer token, or the wrong one"}
        secured = {"dependencies": [Security(HTTPBearer(auto_error=False, description="serve.auth_token_env / "
                                                        "serve.auth_token_file; checked before the body is read"))]}

    @api.post(SCORE_ROUTE, response_model=ScoreResponse, responses=errors, summary=f"Score {testbed} samples",
              **secured)
    async def score(request: request_model) -> ScoreResponse:  # type: ignore[valid-type]
        return await ens.score_request(request.batch())

    @api.get(MODELS_ROUTE, response_model=ModelsResponse, summary="The reward models of this app",
             responses={401: errors[401]} if auth else None, **secured)
    async def models() -> ModelsResponse:
        return await ens.models()

    @api.get(HEALTH_ROUTE, response_model=HealthResponse, summary="Every model answers (no token needed)")
    async def healthz() -> HealthResponse:
        return await ens.health()

    @api.post(LEGACY_ROUTES[testbed], response_model=ScoreResponse, include_in_schema=False, deprecated=True)
    async def score_legacy(request: legacy_model) -> ScoreResponse:  # type: ignore[valid-type]
        return await ens.score_request(request.batch())

    def wrong_route(route: str) -> Any:
        async def refuse() -> None:
            from fastapi import HTTPException

            raise HTTPException(status_code=400, detail=f"this reward app scores the {testbed!r} testbed: POST "
                                f"{SCORE_ROUTE} (or the deprecated {LEGACY_ROUTES[testbed]}), not {route}")
        return refuse

    for other, route in LEGACY_ROUTES.items():
        if other != testbed:
            api.post(route, include_in_schema=False)(wrong_route(route))
    return api


# ------------------------------------------------------------------------------------- application


def build_reward_app(cfg: RewardConfig | VerifierSpec | ImageRewardConfig,
                     serve_cfg: ServeConfig | None = None) -> serve.Application:
    """Bind one deployment per reward model and the ensemble ingress (a testbed's `reward_spec()`: the digits
    classifier ensemble, the arith verifier with its exact-match monitor, or the text-to-image models).
    Deployments are named `reward_<name>` (trained on) and `monitor_<name>` (watch only). The bearer token (if
    `serve_cfg` asks for one) is read here, where the app is built; only its SHA-256 goes to the replicas."""
    serve_cfg = serve_cfg or ServeConfig()
    rest = RestSettings.from_config(serve_cfg)
    opts: dict[str, Any] = {"ray_actor_options": {"num_cpus": serve_cfg.replica_cpus},
                            "max_ongoing_requests": serve_cfg.max_ongoing_requests}
    batching = {"max_batch_size": serve_cfg.max_batch_size, "batch_wait_timeout_s": serve_cfg.batch_wait_timeout_s,
                "batching": serve_cfg.batching}
    digest = app_digest(cfg, serve_cfg)

    def model(name: str, spec: Any) -> serve.Application:
        model_opts = opts
        if getattr(spec, "device", "cpu").startswith("cuda"):  # a model on cuda reserves its share of a GPU
            model_opts = {**opts, "ray_actor_options": {**opts["ray_actor_options"],
                                                        "num_gpus": serve_cfg.replica_gpus}}
        return RewardModelDeployment.options(name=name, **model_opts).bind(spec.model_dump(), **batching)

    ingress = RewardEnsembleIngress.options(name="ensemble", **opts)
    if isinstance(cfg, VerifierSpec):
        exact = cfg.model_copy(update={"partial_credit": False, "name": "exact"})
        return ingress.bind([model(f"reward_{cfg.name}", cfg)], [cfg.name], [model("monitor_exact", exact)],
                            ["exact"], cfg.name, cfg.name, "arith", ["exact"], rest, digest)
    if isinstance(cfg, ImageRewardConfig):
        trained, monitors = cfg.trained_specs(), cfg.monitor_specs()
        return ingress.bind([model(f"reward_{s.name}", s) for s in trained], [s.name for s in trained],
                            [model(f"monitor_{s.name}", s) for s in monitors], [s.name for s in monitors],
                            cfg.train_on, cfg.feature_model_name(), "text_to_image", (), rest, digest)
    specs = cfg.member_specs()
    members = [model(f"reward_{s.name}", s) for s in specs]
    gold = model(f"monitor_{cfg.gold.name}", cfg.gold)
    return ingress.bind(members, [s.name for s in specs], [gold], [cfg.gold.name], cfg.train_on, cfg.feature_model,
                        "digits", [cfg.gold.name], rest, digest)


# ServeConfig fields that shape the app (host/port are the proxy's; timeouts and retries are the callers')
APP_SETTINGS = ("replica_cpus", "replica_gpus", "batching", "max_batch_size", "batch_wait_timeout_s",
                "max_ongoing_requests", "max_request_samples", "max_body_bytes")


def app_digest(cfg: RewardConfig | VerifierSpec | ImageRewardConfig, serve_cfg: ServeConfig) -> str:
    """SHA-256 of what an app is built from: the reward models' specs, the settings that shape the deployments
    and the REST API, and the bearer token's own digest."""
    rest = RestSettings.from_config(serve_cfg)
    from importlib.metadata import version

    payload = {"steadyrl": version("steadyrl"), "kind": type(cfg).__name__, "spec": cfg.model_dump(mode="json"),
               "serve": {k: getattr(serve_cfg, k) for k in APP_SETTINGS}, "token": rest.token_sha256}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def running_app_digest(name: str = APP_NAME) -> str | None:
    """The digest of the app `name` if it is deployed and RUNNING (None otherwise)."""
    app = serve.status().applications.get(name)
    if app is None or app.status != "RUNNING":
        return None
    try:
        return serve.get_app_handle(name).app_digest.remote().result(timeout_s=30)
    except Exception:  # noqa: BLE001 - an app of another build (no app_digest) or not answering: not ours
        return None


def deploy_reward_app(cfg: RewardConfig | VerifierSpec | ImageRewardConfig, serve_cfg: ServeConfig | None = None,
                      name: str = APP_NAME, route_prefix: str = ROUTE_PREFIX, reuse: bool = False) -> bool:
    """Deploy (or update) the ensemble as the Serve application `name` (default `reward`) under `route_prefix`
    (default /reward). With `reuse`, an app of that name already running the same ensemble (same `app_digest`:
    a RayService's, or an earlier run's on this cluster) is left as it is. Returns whether it deployed."""
    serve_cfg = serve_cfg or ServeConfig()
    if reuse and route_prefix == ROUTE_PREFIX and running_app_digest(name) == app_digest(cfg, serve_cfg):
        return False
    serve.run(build_reward_app(cfg, serve_cfg), name=name, route_prefix=route_prefix)
    return True


def app_builder(args: dict[str, Any]) -> serve.Application:
    """Serve config entry point (`import_path: steadyrl.services.reward_app:app_builder`, as in
    deploy/rayservice-reward.yaml): args `config` (a preset) and `overrides` (key=value), as on the command line."""
    from steadyrl.services.config import load_config
    from steadyrl.services.testbeds import build_testbed

    cfg = load_config(args.get("config"), list(args.get("overrides") or []))
    testbed = build_testbed(cfg)
    testbed.prepare_rewards()
    return build_reward_app(testbed.reward_spec(), cfg.serve)
