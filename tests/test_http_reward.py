"""Remote scorers (`kind: http`, reward/http_reward.py), each protocol against a real server on 127.0.0.1 started
here: a small FastAPI scorer speaking flow_grpo's pickled reward-server format, and the session's steadyrl digits
reward service (one steadyrl service scoring another's training). The chat-judge protocol is tested against vLLM's
OpenAI-compatible server in tests/vllm_backend/test_vllm_judge.py."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import math
import pickle
import time

import numpy as np
import pytest
import torch
from fastapi import FastAPI, Request, Response
from PIL import Image
from pydantic import ValidationError

from steadyrl.reward.classifiers import load_classifier
from steadyrl.reward.factory import build_reward_model, parse_reward_spec
from steadyrl.reward.http_transport import RemoteScorerError
from steadyrl.services.config import CONFIG_DIR, ConfigError, load_config
from steadyrl.services.runtime.retry import is_process_failure
from tests.helpers import SMOKE_SHORT, computed_metrics, free_port, serving, train_local

SECRET = "s3cret-token-of-the-http-tests"


class Scorer:
    """A flow_grpo-style reward server: pickled {"images": [JPEG bytes], "prompts": [...]} in, pickled
    {"outputs": brightness in [0, 1] plus len(prompt) / 100} out; it can fail its first requests, require a
    token, or answer outside the protocol."""

    def __init__(self, fail_first: int = 0, status: int = 503, token: str | None = None, reply: str = "pickle"):
        self.fail_first, self.status, self.token, self.reply = fail_first, status, token, reply
        self.requests, self.in_flight, self.max_in_flight, self.sizes, self.bodies = 0, 0, 0, [], []

    def app(self) -> FastAPI:
        api = FastAPI()

        @api.post("/score")
        async def score(request: Request) -> Response:
            self.requests += 1
            if self.token is not None and request.headers.get("authorization") != f"Bearer {self.token}":
                return Response("bad token", status_code=401)
            if self.requests <= self.fail_first:
                return Response("warming up", status_code=self.status)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            await asyncio.sleep(0.05)
            self.in_flight -= 1
            body = pickle.loads(await request.body())
            self.sizes.append(len(body["images"]))
            self.bodies.append({k: v for k, v in body.items() if k != "images"})
            out = [brightness(Image.open(io.BytesIO(b))) + len(p) / 100 for b, p in zip(body["images"],
                                                                                        body["prompts"])]
            if self.reply == "json":
                return Response(json.dumps({"outputs": out}), media_type="application/json")
            key = "outputs" if self.reply == "pickle" else "scores"
            return Response(pickle.dumps({key: out}), media_type="application/octet-stream")

        return api


def brightness(image: Image.Image) -> float:
    return float(np.asarray(image, dtype=np.float64).mean()) / 255


def spec(url: str, **kw) -> dict:
    return {"kind": "http", "name": "remote", "url": f"{url}/score", "protocol": "flow_grpo", "allow_pickle": True,
            "backoff_s": 0.01, **kw}


def images(n: int, seed: int = 0) -> torch.Tensor:
    return torch.rand(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def reference(samples: torch.Tensor, prompts: list[str]) -> list[float]:
    """What the scorer computes, written from the protocol: uint8 = round((x + 1) * 127.5), JPEG at PIL's
    default quality, decoded, brightness, plus len(prompt) / 100."""
    out = []
    for x, p in zip(samples, prompts):
        arr = ((x.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 0).numpy()
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="JPEG")
        out.append(brightness(Image.open(io.BytesIO(buf.getvalue()))) + len(p) / 100)
    return out


def test_a_flow_grpo_server_scores_chunks_posted_concurrently_in_batch_order():
    scorer = Scorer()
    x, prompts = images(10), [f"prompt {'x' * i}" for i in range(10)]
    with serving(scorer.app()) as url:
        model = build_reward_model(spec(url, batch_size=3, max_concurrency=2))
        scores = model.score(x, prompts)
    assert sorted(scorer.sizes) == [1, 3, 3, 3]  # 10 samples in chunks of 3
    assert scorer.max_in_flight == 2  # bounded by max_concurrency, and used
    assert scores.dtype == torch.float32 and scores.shape == (10,)
    assert torch.allclose(scores, torch.tensor(reference(x, prompts), dtype=torch.float32))


def test_5xx_replies_are_retried_with_backoff_and_a_4xx_reply_is_not():
    flaky = Scorer(fail_first=2, status=503)
    with serving(flaky.app()) as url:
        model = build_reward_model(spec(url, retries=2, max_concurrency=1, backoff_s=0.1))
        t0 = time.perf_counter()
        model.score(images(2), ["a", "b"])
        waited = time.perf_counter() - t0
    assert flaky.requests == 3  # two 503s, then the answer (the probe is a GET, answered 405 by the route)
    assert waited >= 0.1 + 0.2  # backoff_s * 2**(k - 1) before retries k = 1, 2
    refusing = Scorer(fail_first=10, status=422)
    with serving(refusing.app()) as url:
        model = build_reward_model(spec(url, retries=3))
        with pytest.raises(RemoteScorerError, match=r"reward 'remote' .*/score refused the request: HTTP 422"):
            model.score(images(2), ["a", "b"])
    assert refusing.requests == 1  # one 422: never sent again


def test_a_server_that_stays_down_is_an_error_naming_the_reward_and_url_that_the_runtime_does_not_retry():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RemoteScorerError) as err:
        build_reward_model(spec(url, retries=2))
    message = str(err.value)
    assert "reward 'remote'" in message and f"{url}/score did not answer after 3 attempts" in message
    assert "ConnectError" in message
    assert not is_process_failure(err.value)  # a scorer that is down is not a lost Ray process: no step retry


def test_the_auth_header_comes_from_an_env_var_or_a_file_and_never_appears_in_errors(tmp_path, monkeypatch):
    scorer = Scorer(token=SECRET)
    secret_file = tmp_path / "token"
    secret_file.write_text(SECRET + "\n")
    with serving(scorer.app()) as url:
        with pytest.raises(RemoteScorerError, match="auth.env='STEADYRL_TEST_SCORER_TOKEN': .* not set"):
            build_reward_model(spec(url, auth={"env": "STEADYRL_TEST_SCORER_TOKEN"}))
        monkeypatch.setenv("STEADYRL_TEST_SCORER_TOKEN", SECRET)
        by_env = build_reward_model(spec(url, auth={"env": "STEADYRL_TEST_SCORER_TOKEN"}))
        by_file = build_reward_model(spec(url, auth={"file": str(secret_file)}))
        x, prompts = images(3), ["a", "b", "c"]
        assert torch.equal(by_env.score(x, prompts), by_file.score(x, prompts))
        monkeypatch.setenv("STEADYRL_TEST_SCORER_TOKEN", "wrong-" + SECRET)
        wrong = build_reward_model(spec(url, auth={"env": "STEADYRL_TEST_SCORER_TOKEN"}))
        with pytest.raises(RemoteScorerError, match="HTTP 401") as err:
            wrong.score(x, prompts)
    assert SECRET not in str(err.value) and SECRET not in repr(by_env.spec)
    assert SECRET.encode() not in pickle.dumps(by_env.spec)
    with pytest.raises(ValidationError, match="exactly one of env"):
        parse_reward_spec(spec("http://127.0.0.1:1", auth={"env": "A", "file": "b"}))


def test_flow_grpo_needs_allow_pickle_and_a_reply_outside_its_protocol_is_named():
    with pytest.raises(ValidationError, match="allow_pickle: true.*runs whatever code"):
        parse_reward_spec({**spec("http://127.0.0.1:1"), "allow_pickle": False})
    with serving(Scorer(reply="json").app()) as url:
        with pytest.raises(RemoteScorerError, match="not a pickle"):
            build_reward_model(spec(url)).score(images(2), ["a", "b"])
    with serving(Scorer(reply="other_key").app()) as url:
        with pytest.raises(RemoteScorerError, match=r"without 'outputs' \(got \['scores'\]\); set score_key"):
            build_reward_model(spec(url)).score(images(2), ["a", "b"])
        keyed = build_reward_model(spec(url, flow_grpo={"score_key": "scores"}))
        assert keyed.score(images(2), ["a", "b"]).shape == (2,)


def test_a_steadyrl_service_scores_any_of_its_columns_as_its_model_scores_in_process(reward_url):
    cfg = load_config(CONFIG_DIR / "smoke.yaml")
    cnn = load_classifier(next(m for m in cfg.testbed.reward.members if m.name == "cnn"))
    x = torch.rand(12, 1, 8, 8, generator=torch.Generator().manual_seed(3)) * 2 - 1
    cond = torch.arange(12) % 10
    remote = build_reward_model({"kind": "http", "name": "remote_cnn", "url": reward_url, "column": "cnn"})
    assert torch.equal(remote.score(x, cond), cnn.score(x, cond))  # floats travel exactly as JSON
    gold = build_reward_model({"kind": "http", "name": "remote_gold", "url": reward_url, "column": "gold"})
    assert gold.score(x, cond).shape == (12,)
    with pytest.raises(RemoteScorerError, match=r"column='nope' is not among .*'cnn', 'mlp', 'linear', 'gold'"):
        build_reward_model({"kind": "http", "name": "remote", "url": reward_url, "column": "nope"})
    with serving(Scorer().app()) as url:  # a server that is not a steadyrl reward service
        with pytest.raises(RemoteScorerError, match="/healthz did not answer as a steadyrl reward service"):
            build_reward_model({"kind": "http", "name": "remote", "url": url})


def test_one_steadyrl_service_scores_anothers_training_exactly_as_the_model_in_process(reward_url, tmp_path):
    """Two local runs with the same members (the CNN in process, and the same CNN behind the session's reward
    service): trained on the remote column, the run is the run trained on the in-process CNN, bit for bit. One
    request carries the whole batch (batch_size 64 > 40 samples): a convolution's float sums depend on its batch
    shape, so chunks of 32 + 8 may differ from the in-process batch of 40 in the last bit."""
    remote = (f"testbed.reward.functions=[{{kind: http, name: remote_cnn, url: '{reward_url}', column: cnn, "
              "batch_size: 64}]")
    common = [*SMOKE_SHORT, "run.steps=2", "run.checkpoint_every=2", "run.eval_every=2", remote]
    on_remote, rows = train_local(CONFIG_DIR / "smoke.yaml", tmp_path / "remote",
                                  [*common, "testbed.reward.train_on=remote_cnn"])
    in_process, rows_cnn = train_local(CONFIG_DIR / "smoke.yaml", tmp_path / "cnn", common)
    assert [r["reward/remote_cnn"] for r in rows] == [r["reward/cnn"] for r in rows]
    assert computed_metrics(rows) == computed_metrics(rows_cnn)
    assert (on_remote.run_dir / "evals.json").read_text() == (in_process.run_dir / "evals.json").read_text()


def test_an_unreachable_scorer_fails_the_job_before_anything_starts(tmp_path):
    from steadyrl.services.driver.controller import train

    url = f"http://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    expected = rf"reward 'judge' \(kind http, steadyrl\): {url}/healthz did not answer after 1 attempt"
    with pytest.raises(ConfigError, match=expected):
        train(CONFIG_DIR / "smoke.yaml", [f"run.run_dir={run_dir}", "run.runtime=local", "run.progress=false",
                                          f"testbed.reward.functions=[{{kind: http, name: judge, url: '{url}', "
                                          "retries: 0}]"])
    assert not run_dir.exists()


def test_inside_a_serve_replica_a_remote_scorer_scores_text_as_the_service_it_calls(serve_port, tmp_path):
    """Two arith reward apps on the session's Serve (real HTTP on 127.0.0.1): `inner` scores with a function,
    `outer`'s member is `inner` behind kind http (running inside outer's Serve replica). Text posted to `outer`
    comes back scored as `inner` scores it, trained on."""
    import httpx
    from ray import serve

    from steadyrl.services.config import ServeConfig
    from steadyrl.services.serving import deploy_reward_app
    from steadyrl.services.testbeds.arith.masked import ArithSettings
    from tests.helpers import make_testbed

    rewards = tmp_path / "text_rewards.py"
    rewards.write_text("def length(completions, prompts, answers):\n    return [len(c) + 0.5 for c in completions]\n")
    inner = ArithSettings(functions=[{"name": "length", "function": f"{rewards}:length"}], train_on="length")
    deploy_reward_app(make_testbed(inner), ServeConfig(), name="inner-arith", route_prefix="/inner-arith")
    try:
        url = f"http://127.0.0.1:{serve_port}/inner-arith"
        outer = ArithSettings(functions=[{"kind": "http", "name": "remote", "url": url}], train_on="remote")
        deploy_reward_app(make_testbed(outer), ServeConfig(), name="outer-arith", route_prefix="/outer-arith")
        body = {"kind": "arith", "samples": [{"prompt": "07+45=", "completion": "52"},
                                             {"prompt": "1+1=", "completion": "12345"}]}
        out = httpx.post(f"http://127.0.0.1:{serve_port}/outer-arith/v1/score", json=body, timeout=120).json()
        assert out["names"] == ["verifier", "remote"] and out["reward"] == [2.5, 5.5]
        assert out["monitors"]["exact_correct"] == [1.0, 0.0]
    finally:
        for app in ("outer-arith", "inner-arith"):
            serve.delete(app)


def chat_judge() -> tuple[FastAPI, list[dict]]:
    """An OpenAI-shaped chat endpoint that reads the image of each request: the reply 'Final Score: 5 x brightness'
    (or no score for a dark image), or under logprobs the first token's alternatives, 'Yes' split over two
    spellings. (vLLM's own server is tested on text in tests/vllm_backend/test_vllm_judge.py.)"""
    api, seen = FastAPI(), []

    @api.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "vlm-judge", "object": "model"}]}

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> dict:
        body = await request.json()
        seen.append(body)
        image_part, text_part = body["messages"][0]["content"]
        png = base64.b64decode(image_part["image_url"]["url"].removeprefix("data:image/png;base64,"))
        level = brightness(Image.open(io.BytesIO(png)))
        if body.get("logprobs"):
            top = [{"token": "Yes", "logprob": math.log(0.3 * level)}, {"token": " Yes", "logprob": math.log(0.2)},
                   {"token": "No", "logprob": math.log(0.25)}, {"token": "Maybe", "logprob": math.log(0.2)}]
            return {"choices": [{"message": {"content": "Yes"}, "logprobs": {"content": [{"token": "Yes",
                                                                                         "top_logprobs": top}]}}]}
        content = f"The image matches. Final Score: {5 * level:.4f}" if level > 0.2 else "I cannot tell."
        return {"choices": [{"message": {"role": "assistant", "content": content}}]}

    return api, seen


def test_a_chat_judge_sees_the_image_as_a_data_url_with_the_template_and_its_answer_becomes_the_score():
    api, seen = chat_judge()
    x = torch.stack([torch.full((3, 8, 8), v) for v in (-0.9, 0.0, 0.8)])  # dark, grey, bright
    prompts = ["a cat", "a dog", "a fox"]
    with serving(api) as url:
        judge = {"model": "vlm-judge", "template": "Does the image show {prompt}?"}
        reply = build_reward_model({"kind": "http", "name": "vlm", "url": f"{url}/v1", "protocol": "openai_chat",
                                    "judge": {**judge, "pattern": r"Final Score:\s*([0-9.]+)", "scale": 0.2,
                                              "unparsed": "nan"}})
        scores = reply.score(x, prompts)
        logprobs = build_reward_model({"kind": "http", "name": "vlm", "url": f"{url}/v1", "protocol": "openai_chat",
                                       "judge": {**judge, "score": "logprobs"}})
        expected = logprobs.score(x, prompts)
    levels = [brightness(Image.fromarray(a)) for a in ((x + 1) * 127.5).round().to(torch.uint8)
              .permute(0, 2, 3, 1).numpy()]
    assert math.isnan(scores[0]) and torch.allclose(scores[1:], torch.tensor(levels[1:]), atol=1e-4)
    assert torch.allclose(expected, torch.tensor([(0.3 * v + 0.2) / (0.3 * v + 0.2 + 0.25) for v in levels]))
    first = seen[0]
    assert first["model"] == "vlm-judge" and first["temperature"] == 0.0 and first["max_tokens"] == 64
    assert first["messages"][0]["content"][1] == {"type": "text", "text": "Does the image show a cat?"}
    assert seen[-1]["logprobs"] is True and seen[-1]["max_tokens"] == 1 and len(seen) == 6  # one sample a request


def test_flow_grpo_bodies_carry_the_prompts_metadata_and_extra_fields_when_asked(tmp_path):
    """On text-to-image with `metadata: true` the testbed fills in the .jsonl prompt set's metadata and each body
    carries it as 'meta_datas' (GenEval's server reads it), beside the prompts and `extra_fields`."""
    from steadyrl.services.testbeds.text_to_image.testbed import TextToImageSettings
    from tests.helpers import make_testbed

    prompts = tmp_path / "counting.jsonl"
    prompts.write_text('{"prompt": "two cats", "count": 2}\n{"prompt": "a fox"}\n{"prompt": "four owls", "count": 4}\n')
    scorer = Scorer()
    with serving(scorer.app()) as url:
        settings = TextToImageSettings(pretrained="unused/by-reward-spec", prompts={"train": str(prompts)}, reward={
            "models": [spec(url, metadata=True, flow_grpo={"extra_fields": {"only_strict": False}})]})
        ensemble = make_testbed(settings).reward_spec().build()
        ensemble.score_all(images(3), ["four owls", "a fox", "two cats"])
    assert scorer.bodies == [{"prompts": ["four owls", "a fox", "two cats"], "only_strict": False,
                              "meta_datas": [{"count": 4}, {}, {"count": 2}]}]
    with pytest.raises(ValidationError, match="metadata: true is sent by protocol flow_grpo only"):
        parse_reward_spec({"kind": "http", "name": "r", "url": "http://127.0.0.1:1", "metadata": True})
