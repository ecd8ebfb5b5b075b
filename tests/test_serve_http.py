"""The reward ensemble as a real Ray Serve application, over HTTP on 127.0.0.1 and by handle.

The session's digits app (`reward_url`, default `ServeConfig`) is used as it is. Limits and the bearer token are
tested on a second, cheap app (the arith verifier) deployed here under its own name with a small `ServeConfig`,
and deleted at the end, so the other tests' app never changes.
"""
from __future__ import annotations

import hashlib
import json
import os

import httpx
import jsonschema
import pytest
import torch

from steadyrl.rollout.digits import digit_splits, load_digits_tensors
from steadyrl.services.testbeds import ArithSettings, DigitsSettings
from tests.helpers import make_testbed

GUARDED_APP, GUARDED_PREFIX = "reward_guarded_test", "/reward_guarded_test"
TOKEN_ENV, TOKEN = "STEADYRL_TEST_REWARD_TOKEN", "t0ken-for-the-http-tests"
MAX_SAMPLES, MAX_BODY = 4, 4096
ZEROS = [[0.0] * 8] * 8


@pytest.fixture(scope="module")
def digits():
    images, labels = load_digits_tensors()
    idx = torch.as_tensor(digit_splits().test[:24])
    return images[idx], labels[idx]


def records(images: torch.Tensor, labels: torch.Tensor, groups: list[int] | None = None) -> list[dict]:
    out = [{"image": img[0].tolist(), "digit": int(y)} for img, y in zip(images, labels)]
    for rec, g in zip(out, groups or []):
        rec["group"] = g
    return out


def locs(resp: httpx.Response) -> list[str]:
    return [".".join(str(p) for p in e["loc"]) for e in resp.json()["detail"]]


def post_raw(url: str, text: str, **headers: str) -> httpx.Response:
    return httpx.post(url, content=text.encode(), headers={"content-type": "application/json", **headers}, timeout=60)


# ------------------------------------------------------------------------------- the digits app (v1)


def test_v1_score_scores_real_digits(reward_url, digits):
    images, labels = digits
    groups = [i // 8 for i in range(24)]
    resp = httpx.post(f"{reward_url}/v1/score", json={"kind": "digits", "samples": records(images, labels, groups)},
                      timeout=60)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["names"] == ["cnn", "mlp", "linear"] and out["train_on"] == "cnn"
    scores = torch.tensor(out["scores"])
    assert scores.shape == (24, 3)
    assert torch.allclose(torch.tensor(out["mean"]), scores.mean(1), atol=1e-5)
    assert torch.allclose(torch.tensor(out["reward"]), scores[:, 0])
    assert sum(out["monitors"]["gold_correct"]) >= 22  # real digits: the gold judge agrees
    assert all(0 <= u <= 0.5 for u in out["uncertainty"])
    # asking for the wrong digit drops the reward
    wrong = httpx.post(f"{reward_url}/v1/score", json={"samples": records(images, (labels + 1) % 10, groups)},
                       timeout=60).json()
    assert sum(wrong["reward"]) < 0.2 * sum(out["reward"])
    # the tensor layout [1,8,8] per image scores the same as [8,8]
    chw = [{"image": img.tolist(), "digit": int(y), "group": g} for img, y, g in zip(images, labels, groups)]
    same = httpx.post(f"{reward_url}/v1/score", json={"samples": chw}, timeout=60).json()
    assert torch.allclose(torch.tensor(same["scores"]), scores)


def test_deprecated_parallel_array_route_still_scores_the_same(reward_url, digits):
    images, labels = digits
    v1 = httpx.post(f"{reward_url}/v1/score", json={"samples": records(images[:6], labels[:6])}, timeout=60).json()
    old = httpx.post(f"{reward_url}/score", json={"samples": images[:6].tolist(), "cond": labels[:6].tolist()},
                     timeout=60)
    assert old.status_code == 200, old.text
    assert torch.allclose(torch.tensor(old.json()["scores"]), torch.tensor(v1["scores"]))


def test_v1_models_lists_the_ensemble(reward_url):
    out = httpx.get(f"{reward_url}/v1/models", timeout=30).json()
    assert out["testbed"] == "digits" and out["train_on"] == "cnn" and out["feature_model"] == "cnn"
    models = {m["name"]: m for m in out["models"]}
    assert [m["name"] for m in out["models"]] == ["cnn", "mlp", "linear", "gold"]
    assert {n: (m["role"], m["trained_on"]) for n, m in models.items()} == {
        "cnn": ("member", True), "mlp": ("member", False), "linear": ("member", False), "gold": ("monitor", False)}
    assert {m["kind"] for m in out["models"]} == {"classifier"}
    assert all(0.9 <= m["test_accuracy"] <= 1 for m in out["models"])


def test_healthz_reports_every_model(reward_url):
    health = httpx.get(f"{reward_url}/healthz", timeout=30).json()
    assert health["status"] == "ok" and health["gold"] == "gold" and health["route"] == "/v1/score"
    assert {m["name"] for m in health["models"]} == {"cnn", "mlp", "linear", "gold"}
    assert httpx.get(f"{reward_url}/docs", timeout=30).status_code == 200


BAD = [
    ({"samples": [{"image": ZEROS, "digit": 1, "cond": 2}]}, "samples.0.cond"),  # unknown key
    ({"samples": [{"image": [[0.0] * 7] * 8, "digit": 1}]}, "samples.0.image"),
    ({"samples": [{"image": [[0.0] * 8] * 9, "digit": 1}]}, "samples.0.image"),
    ({"samples": [{"image": ZEROS, "digit": 12}]}, "samples.0.digit"),
    ({"samples": [{"image": ZEROS, "digit": "3"}]}, "samples.0.digit"),  # a string is not a number
    ({"samples": [{"image": [[["a"] * 8] * 8], "digit": 1}]}, "samples.0.image"),
    ({"samples": [{"image": ZEROS}]}, "samples.0.digit"),
    ({"samples": []}, "samples"),
    ({"cond": [1]}, "samples"),
    ({"kind": "arith", "samples": [{"image": ZEROS, "digit": 1}]}, "kind"),  # this app scores digits
    ({"samples": [{"image": ZEROS, "digit": 1, "group": 2**31}]}, "samples.0.group"),
]


@pytest.mark.parametrize("body, field", BAD)
def test_bad_request_body_gets_422_naming_the_field(reward_url, body, field):
    resp = httpx.post(f"{reward_url}/v1/score", json=body, timeout=30)
    assert resp.status_code == 422, resp.text
    assert any(loc.startswith(f"body.{field}") for loc in locs(resp)), resp.json()


def test_nan_literal_is_a_422_naming_the_field_not_a_500(reward_url):
    """JSON's non-standard NaN / Infinity literals parse as floats; the 422 names the pixel and echoes nothing
    (echoing a NaN cannot be encoded: that was a 500)."""
    rows = json.dumps(ZEROS[1:])[1:-1]
    for literal in ("NaN", "Infinity", "-Infinity"):
        body = f'{{"samples": [{{"image": [[0, 0, {literal}, 0, 0, 0, 0, 0], {rows}], "digit": 1}}]}}'
        resp = post_raw(f"{reward_url}/v1/score", body)
        assert resp.status_code == 422, (literal, resp.status_code, resp.text)
        json.loads(resp.text, parse_constant=lambda c: pytest.fail(f"the 422 echoes {c}"))
        assert any(loc.startswith("body.samples.0.image") and loc.endswith(".0.2") for loc in locs(resp))
        assert "finite" in resp.text
    legacy = post_raw(f"{reward_url}/score", f'{{"samples": [[[NaN, 0, 0, 0, 0, 0, 0, 0], {rows}]], "cond": [1]}}')
    assert legacy.status_code == 422 and any(loc.startswith("body.samples.0") for loc in locs(legacy))


@pytest.mark.parametrize("value", [1e308, -1e308, 2.5, -3.0])
def test_values_outside_model_space_are_a_422_naming_the_field(reward_url, value):
    image = [row[:] for row in ZEROS]
    image[3][4] = value
    resp = httpx.post(f"{reward_url}/v1/score", json={"samples": [{"image": image, "digit": 1}]}, timeout=30)
    assert resp.status_code == 422, resp.text
    assert [loc for loc in locs(resp) if loc.startswith("body.samples.0.image")] and "2" in resp.text
    assert len(resp.json()["detail"]) == 1  # only the bad pixel


def test_edge_of_the_documented_range_is_accepted(reward_url):
    image = [[-2.0, 2.0, -1.0, 1.0, 0.0, 0.5, -0.5, 0.0]] * 8
    resp = httpx.post(f"{reward_url}/v1/score", json={"samples": [{"image": image, "digit": 9}]}, timeout=30)
    assert resp.status_code == 200, resp.text


def test_twenty_thousand_samples_are_refused_naming_samples_and_the_limit(reward_url):
    """The default limit (serve.max_request_samples = 256): the list's length is checked before its items."""
    body = {"samples": [{"image": [[0] * 8] * 8, "digit": 1}] * 20_000}
    resp = httpx.post(f"{reward_url}/v1/score", json=body, timeout=60)
    assert resp.status_code == 422, resp.text
    (err,) = resp.json()["detail"]
    assert err["loc"] == ["body", "samples"] and "256" in err["msg"] and "20000" in err["msg"]
    assert len(resp.content) < 1000  # nothing echoed


def test_many_errors_are_capped_in_one_422(reward_url):
    body = {"samples": [{"image": [[9.0] * 8] * 8, "digit": 1}] * 10}  # 640 bad pixels
    resp = httpx.post(f"{reward_url}/v1/score", json=body, timeout=60)
    assert resp.status_code == 422
    detail = resp.json()["detail"]
    assert len(detail) == 21 and detail[-1]["type"] == "too_many_errors" and "620 more" in detail[-1]["msg"]


def test_openapi_states_the_real_shapes_and_ranges(reward_url):
    """The published schema is exact: nested fixed-length arrays, the pixel range, the digit range, the batch limit;
    a request valid under it is accepted and one invalid under it is refused."""
    spec = httpx.get(f"{reward_url}/openapi.json", timeout=30).json()
    assert {"/v1/score", "/v1/models", "/healthz"} == set(spec["paths"])  # deprecated routes are unpublished
    schemas = spec["components"]["schemas"]
    body = spec["paths"]["/v1/score"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/DigitsRequest"}
    samples = schemas["DigitsRequest"]["properties"]["samples"]
    assert (samples["minItems"], samples["maxItems"]) == (1, 256)
    sample = schemas["DigitsSample"]
    hw, chw = sample["properties"]["image"]["oneOf"]
    assert (hw["minItems"], hw["maxItems"], hw["items"]["minItems"], hw["items"]["maxItems"]) == (8, 8, 8, 8)
    assert hw["items"]["items"] == {"type": "number", "minimum": -2.0, "maximum": 2.0}
    assert (chw["minItems"], chw["maxItems"]) == (1, 1) and chw["items"] == hw
    assert sample["properties"]["digit"].items() >= {"type": "integer", "minimum": 0, "maximum": 9}.items()
    assert sample["additionalProperties"] is False and sorted(sample["required"]) == ["digit", "image"]
    assert {"413", "422"} <= set(spec["paths"]["/v1/score"]["post"]["responses"])

    validator = jsonschema.Draft202012Validator({**body, "components": spec["components"]})
    ok = {"samples": [{"image": [[1.5] * 8] * 8, "digit": 0, "group": 3}, {"image": [ZEROS], "digit": 9}]}
    validator.validate(ok)
    assert httpx.post(f"{reward_url}/v1/score", json=ok, timeout=30).status_code == 200
    bad = {"samples": [{"image": [[2.5] * 8] * 8, "digit": 0}]}
    assert not validator.is_valid(bad)
    assert httpx.post(f"{reward_url}/v1/score", json=bad, timeout=30).status_code == 422


def test_in_cluster_handle_batches_concurrent_calls(reward_url, digits):
    """Concurrent handle calls are answered correctly (the member deployments batch them)."""
    from ray import serve

    from steadyrl.services.serving import APP_NAME

    images, labels = digits
    handle = serve.get_app_handle(APP_NAME)
    responses = [handle.score_tensors.remote(images[i : i + 4], labels[i : i + 4]) for i in range(0, 24, 4)]
    results = [r.result() for r in responses]
    whole = handle.score_tensors.remote(images, labels).result()
    assert torch.allclose(torch.cat([r.scores for r in results]), whole.scores, atol=1e-5)
    assert whole.features is not None and whole.features.shape[0] == 24


# ------------------------------------------------------- limits and the bearer token (a second, small app)


@pytest.fixture(scope="module")
def guarded_url(serve_port):
    """The arith verifier app with a bearer token, at most MAX_SAMPLES samples and MAX_BODY bytes."""
    from ray import serve

    from steadyrl.services.config import ServeConfig
    from steadyrl.services.serving import deploy_reward_app

    os.environ[TOKEN_ENV] = TOKEN
    cfg = ServeConfig(max_request_samples=MAX_SAMPLES, max_body_bytes=MAX_BODY, auth_token_env=TOKEN_ENV)
    deploy_reward_app(make_testbed(ArithSettings()), cfg, name=GUARDED_APP, route_prefix=GUARDED_PREFIX)
    yield f"http://127.0.0.1:{serve_port}{GUARDED_PREFIX}"
    serve.delete(GUARDED_APP)
    os.environ.pop(TOKEN_ENV, None)


AUTH = {"Authorization": f"Bearer {TOKEN}"}
PAIRS = {"kind": "arith", "samples": [{"prompt": "07+45=", "completion": "52"}, {"prompt": "1+1=", "completion": "3"}]}


def test_right_bearer_token_scores(guarded_url):
    resp = httpx.post(f"{guarded_url}/v1/score", json=PAIRS, headers=AUTH, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["reward"] == [1.0, 0.0] and resp.json()["monitors"]["exact_correct"] == [1.0, 0.0]


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"},
                                     {"Authorization": TOKEN}, {"Authorization": f"Bearer {TOKEN}x"}])
def test_missing_or_wrong_bearer_token_is_a_401(guarded_url, headers):
    for method, route, body in (("POST", "/v1/score", PAIRS), ("GET", "/v1/models", None),
                                ("POST", "/score_text", {"prompts": ["1+1="], "completions": ["2"]})):
        resp = httpx.request(method, f"{guarded_url}{route}", json=body, headers=headers, timeout=30)
        assert resp.status_code == 401, (route, resp.text)
        assert resp.headers["www-authenticate"] == "Bearer" and TOKEN not in resp.text


def test_a_bad_body_without_the_token_is_a_401_not_a_422(guarded_url):
    """Nothing about the body is looked at before the token: no validation feedback to strangers."""
    assert post_raw(f"{guarded_url}/v1/score", "{not json").status_code == 401


def test_healthz_and_docs_stay_open_without_the_token(guarded_url):
    health = httpx.get(f"{guarded_url}/healthz", timeout=30)
    assert health.status_code == 200 and health.json()["testbed"] == "arith"
    assert httpx.get(f"{guarded_url}/docs", timeout=30).status_code == 200
    spec = httpx.get(f"{guarded_url}/openapi.json", timeout=30).json()
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert spec["paths"]["/v1/score"]["post"]["security"] == [{"HTTPBearer": []}]
    assert "security" not in spec["paths"]["/healthz"]["get"]
    assert spec["components"]["schemas"]["ArithRequest"]["properties"]["samples"]["maxItems"] == MAX_SAMPLES


def test_v1_models_with_the_token_lists_the_verifier_and_its_monitor(guarded_url):
    out = httpx.get(f"{guarded_url}/v1/models", headers=AUTH, timeout=30).json()
    assert [(m["name"], m["kind"], m["role"], m["trained_on"]) for m in out["models"]] == [
        ("verifier", "verifier", "member", True), ("exact", "verifier", "monitor", False)]


def test_body_over_the_byte_limit_is_a_413(guarded_url):
    body = {"samples": [{"prompt": "1+1=", "completion": "2" * 3000}, {"prompt": "1+1=", "completion": "2" * 3000}]}
    resp = httpx.post(f"{guarded_url}/v1/score", json=body, headers=AUTH, timeout=30)
    assert resp.status_code == 413, resp.text
    assert str(MAX_BODY) in resp.json()["detail"] and "max_body_bytes" in resp.json()["detail"]


def test_streamed_body_over_the_byte_limit_is_a_413_without_content_length(guarded_url):
    """A chunked body declares no length: it is counted as it arrives, and refused past the limit."""
    def chunks():
        yield b'{"samples": [{"prompt": "1+1=", "completion": "'
        for _ in range(10):
            yield b"2" * 1000
        yield b'"}]}'

    resp = httpx.post(f"{guarded_url}/v1/score", content=chunks(), timeout=30,
                      headers={**AUTH, "content-type": "application/json"})
    assert resp.status_code == 413, resp.text


def test_more_samples_than_the_limit_is_a_422_naming_samples_and_the_limit(guarded_url):
    body = {"samples": [{"prompt": "1+1=", "completion": "2"}] * (MAX_SAMPLES + 1)}
    resp = httpx.post(f"{guarded_url}/v1/score", json=body, headers=AUTH, timeout=30)
    assert resp.status_code == 422
    (err,) = resp.json()["detail"]
    assert err["loc"] == ["body", "samples"] and f"at most {MAX_SAMPLES} items" in err["msg"]
    legacy = httpx.post(f"{guarded_url}/score_text", headers=AUTH, timeout=30,
                        json={"prompts": ["1+1="] * (MAX_SAMPLES + 1), "completions": ["2"] * (MAX_SAMPLES + 1)})
    assert legacy.status_code == 422 and ["body", "prompts"] in [e["loc"] for e in legacy.json()["detail"]]


@pytest.mark.parametrize("body, field", [
    ({"prompts": ["07+45="], "completions": ["52", "1"]}, "completions has 2 entries but prompts has 1"),
    ({"prompts": ["07+45="], "completions": ["52"], "group": [0, 1]}, "group has 2 entries but prompts has 1"),
])
def test_deprecated_bodies_share_one_lengths_check(guarded_url, body, field):
    resp = httpx.post(f"{guarded_url}/score_text", json=body, headers=AUTH, timeout=30)
    assert resp.status_code == 422 and field in resp.text


def test_token_ids_score_like_text_and_bad_ids_name_the_field(guarded_url):
    from steadyrl.rollout.arith import TOKENIZER

    ids = {"samples": [{"prompt": TOKENIZER.encode("07+45="), "completion": TOKENIZER.encode("52") + [2, 2]}]}
    assert httpx.post(f"{guarded_url}/v1/score", json=ids, headers=AUTH, timeout=30).json()["reward"] == [1.0]
    neg = httpx.post(f"{guarded_url}/v1/score", json={"samples": [{"prompt": [-1], "completion": "5"}]},
                     headers=AUTH, timeout=30)
    assert neg.status_code == 422 and "token ids must be >= 0" in neg.text
    assert any(loc.startswith("body.samples.0.prompt") for loc in locs(neg))


def test_only_the_tokens_digest_reaches_the_replicas(monkeypatch):
    """The app's bound arguments (what Serve ships to, and keeps for, its replicas) hold a SHA-256, not the token."""
    from steadyrl.services.config import ServeConfig
    from steadyrl.services.serving import build_reward_app

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    from ray import cloudpickle

    app = build_reward_app(make_testbed(ArithSettings()), ServeConfig(auth_token_env=TOKEN_ENV))
    shipped = cloudpickle.dumps(app._bound_deployment)
    assert TOKEN.encode() not in shipped
    assert hashlib.sha256(TOKEN.encode()).hexdigest().encode() in shipped


def test_a_missing_token_source_fails_naming_the_setting(monkeypatch, tmp_path):
    from steadyrl.services.config import ConfigError, ServeConfig, load_config

    monkeypatch.delenv("STEADYRL_NO_SUCH_TOKEN", raising=False)
    with pytest.raises(ValueError, match="serve.auth_token_env='STEADYRL_NO_SUCH_TOKEN'"):
        ServeConfig(auth_token_env="STEADYRL_NO_SUCH_TOKEN").token_sha256()
    with pytest.raises(ValueError, match="serve.auth_token_file"):
        ServeConfig(auth_token_file=str(tmp_path / "none")).token_sha256()
    (tmp_path / "token").write_text(f"  {TOKEN}\n")
    digest = hashlib.sha256(TOKEN.encode()).hexdigest()
    assert ServeConfig(auth_token_file=str(tmp_path / "token")).token_sha256() == digest
    assert ServeConfig().token_sha256() is None
    with pytest.raises(ConfigError, match="not both"):
        load_config(None, ["serve.auth_token_env=X", f"serve.auth_token_file={tmp_path / 'token'}"])


def test_a_token_variable_is_read_once_and_removed_from_the_environment(monkeypatch):
    """What keeps it out of Ray's processes: they start after the token is read and inherit no copy."""
    from steadyrl.services.config import ServeConfig

    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = ServeConfig(auth_token_env=TOKEN_ENV)
    digest = cfg.token_sha256()
    assert digest == hashlib.sha256(TOKEN.encode()).hexdigest() and TOKEN_ENV not in os.environ
    assert cfg.token_sha256() == digest  # kept on the config: the app built later needs no variable


def test_the_rayservice_builder_builds_the_app_a_config_describes():
    """`app_builder` (deploy/rayservice-reward.yaml's import_path) takes a preset and overrides, as the CLI does."""
    from ray import serve

    from steadyrl.services.config import CONFIG_DIR
    from steadyrl.services.serving import app_builder

    app = app_builder({"config": str(CONFIG_DIR / "arith-grpo.yaml"), "overrides": ["serve.max_request_samples=7"]})
    assert isinstance(app, serve.Application)
    settings = app._bound_deployment.init_kwargs["settings"]
    rest, digest = settings.rest, settings.digest
    assert rest.max_samples == 7 and rest.token_sha256 is None
    # the digest a run compares before reusing a running app: it moves with what the app is built from
    from steadyrl.services.config import ServeConfig
    from steadyrl.services.serving import app_digest
    from steadyrl.services.testbeds import ArithTestbed

    spec, rest = make_testbed(ArithSettings(task="addition")).reward_spec(), ArithTestbed.rest
    assert len(digest) == 64
    assert app_digest(spec, rest, ServeConfig()) == app_digest(spec, rest, ServeConfig(port=1234, max_retries=0))
    assert app_digest(spec, rest, ServeConfig()) != app_digest(spec, rest, ServeConfig(max_request_samples=7))
    digits = make_testbed(DigitsSettings())
    assert app_digest(digits.reward_spec(), digits.rest, ServeConfig()) != app_digest(spec, rest, ServeConfig())
