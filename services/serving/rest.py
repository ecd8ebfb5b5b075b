"""The ingress's FastAPI app, built on each replica for its testbed and limits, so the OpenAPI it publishes
(/openapi.json, /docs) states exactly what that app accepts. (No `from __future__ import annotations` here:
FastAPI must see the request models' real types.)"""

from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Security
from fastapi.exceptions import RequestValidationError
from fastapi.security import HTTPBearer
from ray.exceptions import RayActorError
from starlette.exceptions import HTTPException

from steadyrl.services.serving.errors import HEALTH_TIMEOUT_S, ModelsNotAnswering, parse_error, validation_error
from steadyrl.services.serving.guard import RestGuard
from steadyrl.services.serving.schemas import (HEALTH_ROUTE, LEGACY_ROUTES, MODELS_ROUTE, SCORE_ROUTE, ErrorDetail, HealthResponse, ModelsResponse, ScoreResponse,
                                               ValidationErrorResponse, with_max_samples)

if TYPE_CHECKING:
    from steadyrl.services.serving.deployments import RewardEnsembleIngress


def build_rest_api(ens: "RewardEnsembleIngress") -> FastAPI:
    """The ingress's FastAPI app: /v1/score with its testbed's request model and `max_samples`, /v1/models,
    /healthz, the deprecated pre-v1 routes, behind `RestGuard` (token, body size) and 422s that name fields."""
    rest, profile = ens.rest, ens.profile
    testbed = profile.testbed
    request_model = with_max_samples(profile.request, rest.max_samples)
    auth = rest.token_sha256 is not None
    api = FastAPI(
        title="steadyrl reward ensemble", version="1",
        description=f"Scores {testbed} samples with every reward model: per-model scores, mean, spread, training "
        f"reward and rank-disagreement uncertainty per sample, and the monitors' scores. POST {SCORE_ROUTE}: at "
        f"most {rest.max_samples} samples and {rest.max_body_bytes} bytes per request (413 before parsing when "
        "larger). " + ("Every route but /healthz and the docs needs `Authorization: Bearer <token>`." if auth else
                       "No token is needed (serve.auth_token_env / auth_token_file turn one on)."))
    api.add_exception_handler(RequestValidationError, validation_error)
    api.add_exception_handler(HTTPException, parse_error)
    api.add_middleware(RestGuard, settings=rest)
    errors: dict[int | str, dict[str, Any]] = {
        400: {"model": ErrorDetail, "description": "the body cannot be parsed; `detail` says why where the parser "
              "does (nesting too deep, a number over 4300 digits, not UTF-8)"},
        408: {"model": ErrorDetail, "description": f"the body did not arrive within {rest.body_timeout_s:g} s, "
              f"stalled for {rest.body_idle_timeout_s:g} s (serve.body_timeout_s, serve.body_idle_timeout_s), or "
              f"stalled while newer uploads needed its slot (one of {rest.upload_slots}, "
              "serve.max_unfinished_bodies)"},
        413: {"model": ErrorDetail, "description": "body over serve.max_body_bytes (refused before parsing)"},
        415: {"model": ErrorDetail, "description": "the body is not sent as `Content-Type: application/json`"},
        422: {"model": ValidationErrorResponse, "description": "a field is missing, malformed or out of range; "
              "`loc` names it (long keys cut, the input never echoed)"},
        503: {"model": ErrorDetail, "description": "a reward model is being replaced (its replica died): retry "
              "after the `Retry-After` seconds"}}
    secured: dict[str, Any] = {}
    if auth:
        errors[401] = {"model": ErrorDetail, "description": "no bearer token, or the wrong one"}
        secured = {"dependencies": [Security(HTTPBearer(auto_error=False, description="serve.auth_token_env / "
                                                        "serve.auth_token_file; checked before the body is read"))]}

    async def scored(batch: Any) -> ScoreResponse:
        try:
            return await ens.score_request(batch)
        except RayActorError:  # a reward model's replica died mid-call: Serve is starting a new one
            raise HTTPException(status_code=503, headers={"Retry-After": "2"}, detail="a reward model's replica "
                                "died during this request and is being replaced: retry") from None

    @api.post(SCORE_ROUTE, response_model=ScoreResponse, responses=errors, summary=f"Score {testbed} samples",
              **secured)
    async def score(request: request_model) -> ScoreResponse:  # type: ignore[valid-type]
        return await scored(request.batch())

    @api.get(MODELS_ROUTE, response_model=ModelsResponse, summary="The reward models of this app",
             responses={401: errors[401]} if auth else None, **secured)
    async def models() -> ModelsResponse:
        return await ens.models()

    @api.get(HEALTH_ROUTE, response_model=HealthResponse, summary="Every model answers (no token needed)",
             responses={503: {"model": ErrorDetail, "description": "a model did not answer within "
                              f"{HEALTH_TIMEOUT_S:g} s (its replica is being replaced); `detail` names it"}})
    async def healthz() -> HealthResponse:
        try:
            return await ens.health()
        except ModelsNotAnswering as err:
            raise HTTPException(status_code=503, detail=str(err), headers={"Retry-After": "2"}) from None

    if profile.legacy_route is not None and profile.legacy_request is not None:
        legacy_model = with_max_samples(profile.legacy_request, rest.max_samples)

        @api.post(profile.legacy_route, response_model=ScoreResponse, include_in_schema=False, deprecated=True)
        async def score_legacy(request: legacy_model) -> ScoreResponse:  # type: ignore[valid-type]
            return await scored(request.batch())

    also = "" if profile.legacy_route is None else f" (or the deprecated {profile.legacy_route})"

    def wrong_route(route: str) -> Any:
        async def refuse() -> None:
            from fastapi import HTTPException

            raise HTTPException(status_code=400, detail=f"this reward app scores the {testbed!r} testbed: POST "
                                f"{SCORE_ROUTE}{also}, not {route}")
        return refuse

    for route in LEGACY_ROUTES.values():
        if route != profile.legacy_route:
            api.post(route, include_in_schema=False)(wrong_route(route))
    return api
