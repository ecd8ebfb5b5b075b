"""The reward ensemble as a Ray Serve application, with a REST API.

    png          base64 PNG <-> pixels
    schemas      the REST contract: routes, request and response bodies, each testbed's `RestProfile`
    guard        bearer token, body-size limit, 422s that name fields
    rest         the ingress's FastAPI app
    deployments  one deployment per reward model and the ensemble ingress
    app          build, deploy or reuse the application; the Serve config builder

Names are loaded on first use (PEP 562), so a testbed that imports its REST schema does not import Ray.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "app": ("APP_NAME", "ROUTE_PREFIX", "app_builder", "app_digest", "build_reward_app", "deploy_reward_app",
            "running_app_digest"),
    "deployments": ("IngressSettings", "RestSettings", "RewardEnsembleIngress", "RewardModelDeployment"),
    "guard": ("token_digest",),
    "png": ("MAX_IMAGE_SIDE", "decode_png", "encode_png"),
    "rest": ("build_rest_api",),
    "schemas": ("HEALTH_ROUTE", "MODELS_ROUTE", "SCORE_ROUTE", "AnyScoreRequest", "ArithRequest", "DigitsRequest",
                "ScoreResponse", "TextToImageRequest", "RestProfile"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE[name]}"), name)
