"""Property-based fuzzing of the REST reward API with schemathesis, against each app's own OpenAPI, fetched over
HTTP from the real Serve deployment on 127.0.0.1.

Every built-in check runs on every generated request: no 5xx; every schema-valid request accepted
(`positive_data_acceptance`); status codes, content types, headers and bodies as documented; and, on the app with a
bearer token, that a request without it is refused (`ignored_auth`). Bounded (MAX_EXAMPLES per operation) and
derandomized, so CI sees the same requests every run.

Two apps: the session's digits app (no token) and the arith verifier with a token and small limits. The
text-to-image app is not fuzzed here: "a decodable PNG" is not expressible in JSON Schema, so generated strings
would be (rightly) refused; tests/test_serve_images.py covers its bad bodies.
"""
from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

from steadyrl.services.testbeds import ArithSettings
from tests.helpers import make_testbed

MAX_EXAMPLES = 40
FUZZ_SETTINGS = settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None, database=None,
                         phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
ARITH_APP, ARITH_PREFIX = "reward_fuzz_arith", "/reward_fuzz_arith"
TOKEN_ENV, TOKEN = "STEADYRL_FUZZ_TOKEN", "fuzz-token"


@pytest.fixture(scope="module")
def arith_url(serve_port):
    """The arith verifier app, with a bearer token and a small sample limit (deleted at the end)."""
    from ray import serve

    from steadyrl.services.config import ServeConfig
    from steadyrl.services.serving import deploy_reward_app

    os.environ[TOKEN_ENV] = TOKEN
    deploy_reward_app(make_testbed(ArithSettings()), ServeConfig(max_request_samples=8, auth_token_env=TOKEN_ENV), name=ARITH_APP,
                      route_prefix=ARITH_PREFIX)
    yield f"http://127.0.0.1:{serve_port}{ARITH_PREFIX}"
    serve.delete(ARITH_APP)
    os.environ.pop(TOKEN_ENV, None)


def fuzz(base_url: str, headers: dict[str, str] | None = None) -> list[str]:
    """Fuzz every operation of the app's published OpenAPI with every check; the operations' labels."""
    api = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    labels = []
    for result in api.get_all_operations():
        operation = result.ok()  # an unparseable operation fails here

        @FUZZ_SETTINGS
        @given(case=operation.as_strategy())
        def check(case) -> None:
            case.call_and_validate(base_url=base_url, headers=headers, timeout=60)

        check()
        labels.append(operation.label)
    return labels


def test_digits_api_honours_its_openapi(reward_url):
    assert sorted(fuzz(reward_url)) == ["GET /healthz", "GET /v1/models", "POST /v1/score"]


def test_arith_api_with_a_token_honours_its_openapi(arith_url):
    labels = fuzz(arith_url, {"Authorization": f"Bearer {TOKEN}"})
    assert sorted(labels) == ["GET /healthz", "GET /v1/models", "POST /v1/score"]


def test_the_verifier_scores_any_text_without_raising():
    """Behind the fuzzed arith route: '²'.isdigit() holds but int('²') raises, and a 5000-digit answer passes Python's
    int-parsing limit; both are malformed output, which scores 0."""
    from steadyrl.reward.verifiers import verify

    assert verify("addition", "07+45=", "52") == 1.0
    assert verify("addition", "07+45=", "5²") == 0.0
    assert verify("addition", "1" * 5000 + "+1=", "2" * 5000) == 0.0
