"""The reward ensemble as a Ray Serve application, with a REST API.

    schemas      the REST contract: routes and response bodies (each testbed's request body and `RestProfile`
                 live with the testbed, `testbeds/<name>/rest.py`)
    uploads      reading a body against slow clients: deadlines and a bounded pool of uploads
    guard        the gate before any JSON is parsed: token, content type, size, the body (`uploads`)
    errors       422s with short field paths and 400s that say why parsing failed; never the input
    rest         the ingress's FastAPI app
    deployments  one deployment per reward model and the ensemble ingress
    app          build, deploy or reuse the application; the Serve config builder

Names are loaded on first use (PEP 562): a route name or `APP_NAME` does not import Ray and Serve.
"""
from __future__ import annotations

from importlib import import_module
from typing import Any

_WHERE = {
    "app": ("APP_NAME", "ROUTE_PREFIX", "app_builder", "app_digest", "build_reward_app", "deploy_reward_app",
            "replica_gpus", "running_app_digest"),
    "deployments": ("IngressSettings", "RewardEnsembleIngress", "RewardModelDeployment"),
    "guard": ("RestSettings", "token_digest"),
    "rest": ("build_rest_api",),
    "schemas": ("HEALTH_ROUTE", "MODELS_ROUTE", "SCORE_ROUTE", "AnyScoreRequest", "ScoreResponse"),
}
_MODULE = {name: module for module, names in _WHERE.items() for name in names}
__all__ = sorted(_MODULE)


def __getattr__(name: str) -> Any:
    if name not in _MODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_MODULE[name]}"), name)
