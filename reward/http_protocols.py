"""The wire formats a remote scorer speaks (`kind: http`, `protocol:`). Each turns a chunk of samples into one
request and its reply into one score per sample, and says what a reachable server of its kind looks like.

    steadyrl     POST {url}/v1/score, a steadyrl reward service's JSON records (digits: 8x8 floats and the digit;
                 text_to_image: base64 PNG and prompt; arith: prompt and completion text); the score is a column of
                 its reply (`reward`, `mean`, a member's or a monitor's name). Probe: GET {url}/healthz.
    flow_grpo    POST {url}, flow_grpo's reward-server body: pickle.dumps({"images": [JPEG bytes], "prompts": [...],
                 "meta_datas": [...] (with `metadata`), **extra_fields}); the reply is a pickled dict whose `score_key` list holds the scores.
                 Unpickling a reply runs whatever code the server put in it: only with `allow_pickle: true`.
    openai_chat  POST {url}/chat/completions, one sample per request: the image as a PNG data URL (image testbeds)
                 and the judge's template filled with {prompt}, {completion}, {answer}. The score is
                   reply:     float(first match of `pattern` in the reply) * scale
                   logprobs:  sum_a p(a) v_a / sum_a p(a)  over the answer tokens a with values v_a among the first
                              generated token's top log-probabilities (p = exp(logprob))
                 Probe: GET {url}/models lists `model`.
"""
from __future__ import annotations

import base64
import io
import math
import pickle
import re
from typing import Any, Literal, Protocol

import numpy as np
from pydantic import Field, field_validator

from steadyrl.reward.http_transport import HttpSession, RemoteScorerError, Request, Response
from steadyrl.rollout.settings_base import StrictModel

DIGITS_PIXEL_BOUND = 2.0  # a steadyrl digits service accepts pixels in [-2, 2]
Items = dict[str, list[Any]]
"""A chunk of samples as a protocol reads them: `images` (uint8 [H,W,C]) or `completions`, with `prompts`, and
for steadyrl's protocol `samples` (the tensors in model space) and `answers` where the testbed has them."""


class WireProtocol(Protocol):
    chunked: bool  # False: one sample per request

    def probe(self, session: HttpSession) -> None:
        """A `RemoteScorerError` unless a server of this protocol answers at the URL."""

    def request(self, items: Items) -> Request: ...

    def scores(self, reply: Response, n: int) -> list[float]: ...


def png_bytes(image: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(image[..., 0] if image.shape[-1] == 1 else image).save(buffer, format=fmt)
    return buffer.getvalue()


def _json(reply: Response, url: str, what: str) -> Any:
    try:
        return reply.json()
    except ValueError:
        raise RemoteScorerError(f"{url} answered with something that is not JSON; is it {what}?") from None


# ----------------------------------------------------------------------------------- steadyrl


class SteadyrlProtocol:
    """A steadyrl reward service's POST /v1/score (one steadyrl service can score another's training)."""

    chunked = True

    def __init__(self, url: str, column: str):
        self.url, self.column, self.testbed = url, column, None

    def probe(self, session: HttpSession) -> None:
        reply = session.send(Request("GET", f"{self.url}/healthz"), any_reply=True)
        body = _json(reply, self.url, "a steadyrl reward service") if reply.status_code == 200 else None
        if not isinstance(body, dict) or "testbed" not in body or "members" not in body:
            raise RemoteScorerError(f"{self.url}/healthz did not answer as a steadyrl reward service does (HTTP "
                                    f"{reply.status_code}); the url is the service's base with its route prefix, "
                                    "e.g. http://host:8000/reward")
        names = [*body["members"], *body.get("monitors", [])]
        if self.column not in ("reward", "mean", *names):
            raise RemoteScorerError(f"column={self.column!r} is not among the service's columns at {self.url}: "
                                    f"'reward', 'mean' or one of {names}")
        self.testbed = body["testbed"]

    def records(self, items: Items) -> list[dict[str, Any]]:
        if self.testbed == "digits":  # pixels clamped to the range the service accepts (its classifiers clamp to
            # [-1, 1], so the scores are those of the unclamped samples)
            return [{"image": s[0].clamp(-DIGITS_PIXEL_BOUND, DIGITS_PIXEL_BOUND).tolist(), "digit": int(p)}
                    for s, p in zip(items["samples"], items["prompts"])]
        if "images" in items:
            return [{"image": base64.b64encode(png_bytes(img)).decode(), "prompt": p}
                    for img, p in zip(items["images"], items["prompts"])]
        return [{"prompt": p, "completion": c} for p, c in zip(items["prompts"], items["completions"])]

    def request(self, items: Items) -> Request:
        body = {"kind": self.testbed, "samples": self.records(items)}
        return Request("POST", f"{self.url}/v1/score", {"json": body})

    def scores(self, reply: Response, n: int) -> list[float]:
        body = _json(reply, self.url, "a steadyrl reward service")
        try:
            if self.column in ("reward", "mean"):
                return list(body[self.column])
            if self.column in body["names"]:
                k = body["names"].index(self.column)
                return [row[k] for row in body["scores"]]
            return list(body["monitors"][self.column])
        except (KeyError, TypeError, IndexError) as err:
            raise RemoteScorerError(f"{self.url}/v1/score replied without column {self.column!r} ({err!r})") from None


# ----------------------------------------------------------------------------------- flow_grpo


class FlowGrpoSettings(StrictModel):
    """flow_grpo's reward-server body (its rewards.py posts pickled dicts of JPEG bytes)."""

    score_key: str = Field("outputs", description="the reply's key holding the scores: 'outputs' for its DeQA and "
                           "UnifiedReward servers, 'scores' for GenEval")
    send_prompts: bool = Field(True, description="send the prompts as 'prompts' (UnifiedReward reads them; DeQA "
                               "ignores them)")
    extra_fields: dict[str, Any] = Field(default_factory=dict, description="constant fields added to every body, "
                                         "e.g. {only_strict: false} for GenEval")


class FlowGrpoProtocol:
    """flow_grpo's reward-server format (module docstring); the reply is unpickled, so it runs the server's code."""

    chunked = True

    def __init__(self, url: str, settings: FlowGrpoSettings):
        self.url, self.settings = url, settings

    def probe(self, session: HttpSession) -> None:
        session.send(Request("GET", self.url), any_reply=True)  # the route takes POST only: a 405 means it is up

    def request(self, items: Items) -> Request:
        if "images" not in items:
            raise RemoteScorerError(f"{self.url}: flow_grpo's reward-server protocol scores images, not text")
        body: dict[str, Any] = {"images": [png_bytes(img, "JPEG") for img in items["images"]]}
        if self.settings.send_prompts:
            body["prompts"] = list(items["prompts"])
        if "metadata" in items:  # `metadata: true`
            body["meta_datas"] = list(items["metadata"])
        data = pickle.dumps({**body, **self.settings.extra_fields})
        return Request("POST", self.url, {"content": data})

    def scores(self, reply: Response, n: int) -> list[float]:
        try:
            body = pickle.loads(reply.content)  # allow_pickle: true was required to get here
        except Exception as err:
            raise RemoteScorerError(f"{self.url} replied with something that is not a pickle ({err!r}); is it a "
                                    "flow_grpo reward server?") from None
        if not isinstance(body, dict) or self.settings.score_key not in body:
            keys = list(body) if isinstance(body, dict) else type(body).__name__
            raise RemoteScorerError(f"{self.url} replied without {self.settings.score_key!r} (got {keys}); set "
                                    "score_key to the key that holds the scores")
        return list(body[self.settings.score_key])


# ----------------------------------------------------------------------------------- OpenAI-compatible judge


class JudgeSettings(StrictModel):
    """An OpenAI-compatible chat model as a judge: what it is asked and how its answer becomes a score."""

    model: str = Field(description="the served model's name (GET {url}/models lists it)")
    template: str = Field(description="the question; {prompt}, {completion} and {answer} are filled in per sample "
                          "(image testbeds send the image before it)")
    score: Literal["reply", "logprobs"] = Field(
        "reply", description="reply: a number parsed from the answer text; logprobs: the expected value of the "
        "answer tokens' values under their probabilities (smoother: a VLM judge's 'Yes'/'No' confidence)")
    pattern: str = Field(r"(-?\d+(?:\.\d+)?)", description="reply: a regular expression whose first group is the "
                         "score, e.g. 'Final Score:\\s*([1-5](?:\\.\\d+)?)'")
    scale: float = Field(1.0, description="reply: the parsed number is multiplied by this (0.2 maps 1-5 to 0.2-1)")
    answers: dict[str, float] = Field(default_factory=lambda: {"Yes": 1.0, "No": 0.0},
                                      description="logprobs: each answer token's value")
    top_logprobs: int = Field(20, ge=1, description="logprobs: how many of the first token's likeliest "
                              "alternatives the server returns (vLLM's --max-logprobs bounds it)")
    unparsed: float = Field(0.0, description="the score when no number matches or no answer token is among the "
                            "alternatives (flow_grpo's UnifiedReward gives 0); 'nan' skips the sample")
    max_tokens: int = Field(64, ge=1, description="reply: the answer's length limit (logprobs generates one token)")

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            if re.compile(v).groups < 1:
                raise ValueError(f"pattern={v!r} needs a group around the number")
        except re.error as err:
            raise ValueError(f"pattern={v!r} is not a regular expression: {err}") from None
        return v


class OpenAIChatProtocol:
    """An OpenAI-compatible chat endpoint as a judge, one sample per request (module docstring)."""

    chunked = False

    def __init__(self, url: str, judge: JudgeSettings):
        self.url, self.judge = url, judge

    def probe(self, session: HttpSession) -> None:
        body = _json(session.send(Request("GET", f"{self.url}/models")), self.url, "an OpenAI-compatible server")
        try:
            served = [m["id"] for m in body["data"]]
        except (KeyError, TypeError):
            raise RemoteScorerError(f"{self.url}/models did not list models as an OpenAI-compatible server "
                                    "does") from None
        if self.judge.model not in served:
            raise RemoteScorerError(f"judge.model={self.judge.model!r} is not served at {self.url} (it serves "
                                    f"{served})")

    def message(self, items: Items) -> list[dict[str, Any]]:
        fields = {"prompt": items["prompts"][0], "completion": (items.get("completions") or [""])[0],
                  "answer": (items.get("answers") or [None])[0]}
        content: list[dict[str, Any]] = []
        if "images" in items:
            url = "data:image/png;base64," + base64.b64encode(png_bytes(items["images"][0])).decode()
            content.append({"type": "image_url", "image_url": {"url": url}})
        content.append({"type": "text", "text": self.judge.template.format(**fields)})
        return [{"role": "user", "content": content}]

    def request(self, items: Items) -> Request:
        body: dict[str, Any] = {"model": self.judge.model, "messages": self.message(items), "temperature": 0.0}
        if self.judge.score == "logprobs":
            body.update(max_tokens=1, logprobs=True, top_logprobs=self.judge.top_logprobs)
        else:
            body["max_tokens"] = self.judge.max_tokens
        return Request("POST", f"{self.url}/chat/completions", {"json": body})

    def scores(self, reply: Response, n: int) -> list[float]:
        body = _json(reply, self.url, "an OpenAI-compatible server")
        try:
            choice = body["choices"][0]
            if self.judge.score == "logprobs":
                return [self.expected_value(choice["logprobs"]["content"][0]["top_logprobs"])]
            return [self.parsed(choice["message"]["content"] or "")]
        except (KeyError, TypeError, IndexError) as err:
            raise RemoteScorerError(f"{self.url}/chat/completions replied outside the chat completions format "
                                    f"({err!r})") from None

    def parsed(self, text: str) -> float:
        """float(first match's group 1) * scale, else `unparsed`."""
        match = re.search(self.judge.pattern, text)
        if match is None:
            return self.judge.unparsed
        try:
            return float(match.group(1)) * self.judge.scale
        except ValueError:
            return self.judge.unparsed

    def expected_value(self, top: list[dict[str, Any]]) -> float:
        """sum_a p(a) v_a / sum_a p(a) over the answer tokens among the alternatives, else `unparsed`."""
        probs = {}
        for alt in top:
            token = alt["token"].strip()
            if token in self.judge.answers:  # 'Yes' and ' Yes' are one answer
                probs[token] = probs.get(token, 0.0) + math.exp(alt["logprob"])
        total = sum(probs.values())
        if total == 0:
            return self.judge.unparsed
        return sum(p * self.judge.answers[a] for a, p in probs.items()) / total

