"""The REST contract of the reward app: routes and response bodies (each testbed's request body is its own,
`testbeds/<name>/rest.py`, written in `testbeds/rest.py`'s vocabulary). (No `from __future__ import
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

from typing import Annotated, Any, Literal, TypeVar, Union

from pydantic import BaseModel, Field, create_model

from steadyrl.services.testbeds.registry import TESTBEDS
from steadyrl.services.testbeds.rest import StrictBody

SCORE_ROUTE, MODELS_ROUTE, HEALTH_ROUTE = "/v1/score", "/v1/models", "/healthz"
# the deprecated pre-v1 routes (a fixed set: testbeds added since have /v1/score only); an app answers the others' 400
LEGACY_ROUTES = {name: t.rest.legacy_route for name, t in TESTBEDS.items() if t.rest.legacy_route}
MAX_REPORTED_ERRORS = 20  # a 422 lists at most this many field errors (a bad 256-image batch has 16k)

AnyScoreRequest = Annotated[Union[tuple(t.rest.request for t in TESTBEDS.values())],  # type: ignore[misc]
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
    kind: str = Field(description="classifier, jpeg, verifier, clip_score, aesthetic, preference, ocr, python or http")
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
