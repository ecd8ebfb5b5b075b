"""The reward ensemble as a Ray Serve application, with a REST API.

    png          base64 PNG <-> pixels
    schemas      the REST contract: routes, request and response bodies
    guard        bearer token, body-size limit, 422s that name fields
    rest         the ingress's FastAPI app
    deployments  one deployment per reward model and the ensemble ingress
    app          build, deploy or reuse the application; the Serve config builder
"""

from steadyrl.services.serving.app import (APP_NAME, ROUTE_PREFIX, app_builder, app_digest, build_reward_app,
                                           deploy_reward_app, running_app_digest)
from steadyrl.services.serving.deployments import (IngressSettings, RestSettings, RewardEnsembleIngress,
                                                   RewardModelDeployment)
from steadyrl.services.serving.guard import token_digest
from steadyrl.services.serving.png import MAX_IMAGE_SIDE, decode_png, encode_png
from steadyrl.services.serving.rest import build_rest_api
from steadyrl.services.serving.schemas import (HEALTH_ROUTE, LEGACY_ROUTES, MODELS_ROUTE, SCORE_ROUTE, AnyScoreRequest,
                                               ArithRequest, DigitsRequest, ScoreResponse, TextToImageRequest)

__all__ = [
    "APP_NAME", "ROUTE_PREFIX", "SCORE_ROUTE", "MODELS_ROUTE", "HEALTH_ROUTE", "LEGACY_ROUTES", "MAX_IMAGE_SIDE",
    "app_builder", "app_digest", "build_reward_app", "deploy_reward_app", "running_app_digest", "build_rest_api",
    "IngressSettings", "RestSettings", "RewardEnsembleIngress", "RewardModelDeployment", "token_digest",
    "decode_png", "encode_png", "AnyScoreRequest", "ArithRequest", "DigitsRequest", "TextToImageRequest",
    "ScoreResponse",
]
