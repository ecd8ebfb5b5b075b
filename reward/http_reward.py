"""A scorer that runs elsewhere (`kind: http`): batches POSTed to a URL, one score per sample back.

    kind: http
    name: deqa
    url: http://127.0.0.1:18086
    protocol: flow_grpo          # or steadyrl (a steadyrl reward service), openai_chat (a judge model)
    allow_pickle: true           # flow_grpo's replies are pickles: unpickling runs the server's code

A batch is split into chunks of `batch_size` samples (one sample per request for a chat judge), posted with at most
`max_concurrency` in flight, each retried on connection errors and 5xx replies (reward/http_transport.py); the
wire formats are in reward/http_protocols.py. It plugs in where a reward function does (digits
`testbed.reward.functions`, text-to-image `testbed.reward.models`, arith `testbed.functions`), so it is weighted,
watched or gated like any model, inside the Serve ensemble or the local runtime.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator
from torch import Tensor

from steadyrl.reward.base import UserRewardModel
from steadyrl.reward.http_protocols import (FlowGrpoProtocol, FlowGrpoSettings, Items, JudgeSettings,
                                            OpenAIChatProtocol, SteadyrlProtocol, WireProtocol)
from steadyrl.reward.http_transport import HttpSession, HttpTransport, RemoteScorerError
from steadyrl.reward.python_reward import as_scores, to_images, to_prompts
from steadyrl.reward.verifiers import VerifierReward, VerifierSpec


class HttpRewardSpec(HttpTransport):
    """A remote scorer: where it is, which protocol it speaks, and how requests travel."""

    kind: Literal["http"] = "http"
    name: str = Field(description="the reward's name: its column in the ensemble and in the metrics")
    url: str = Field(description="steadyrl: the service's base URL with its route prefix "
                     "(http://host:8000/reward); flow_grpo: the URL it posts to; openai_chat: the API base "
                     "(http://host:8000/v1)")
    protocol: Literal["steadyrl", "flow_grpo", "openai_chat"] = Field(
        "steadyrl", description="the wire format (reward/http_protocols.py)")
    batch_size: int = Field(32, ge=1, description="samples per request (a chat judge takes one per request). A model's "
                            "float sums can depend on its batch shape: scores match the same model in process bit "
                            "for bit only when one request carries the whole batch")
    column: str = Field("reward", description="steadyrl: which column of the service's reply is the score: "
                        "'reward' (its training reward), 'mean', or a member's or monitor's name")
    allow_pickle: bool = Field(False, description="flow_grpo: must be true. Its reward servers reply with pickles, "
                               "and unpickling runs any code the reply names: only for a server you trust")
    flow_grpo: FlowGrpoSettings = Field(default_factory=FlowGrpoSettings, description="flow_grpo: the body's keys")
    judge: JudgeSettings | None = Field(None, description="openai_chat: the model, its question and how its "
                                        "answer becomes a score")
    metadata: bool = Field(False, description="flow_grpo, text-to-image: send each prompt's metadata (the keys "
                           "besides `prompt` of a .jsonl prompt set) as 'meta_datas', as its GenEval server reads them")
    prompt_metadata: dict[str, dict[str, Any]] | None = Field(
        None, description="with `metadata`, the text-to-image testbed fills this in (not a user setting)")
    text: VerifierSpec | None = Field(None, description="language-model testbeds fill this in (not a user "
                                      "setting): the tokenizer that decodes completions and the task's reference "
                                      "answers")

    @model_validator(mode="after")
    def _protocol_settings(self) -> "HttpRewardSpec":
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url={self.url!r} must start with http:// or https://")
        if self.protocol == "flow_grpo" and not self.allow_pickle:
            raise ValueError("protocol 'flow_grpo' needs allow_pickle: true: its servers reply with pickles, and "
                             "unpickling a reply runs whatever code the server put in it; set it only for a server "
                             "you trust")
        if self.protocol == "openai_chat" and self.judge is None:
            raise ValueError("protocol 'openai_chat' needs judge (model, template, and how to score the answer)")
        if self.metadata and self.protocol != "flow_grpo":
            raise ValueError(f"metadata: true is sent by protocol flow_grpo only, not {self.protocol!r}")
        if self.protocol != "openai_chat" and self.judge is not None:
            raise ValueError(f"judge is set but protocol is {self.protocol!r}: a judge needs protocol openai_chat")
        return self

    def wire(self) -> WireProtocol:
        url = self.url.rstrip("/")
        if self.protocol == "steadyrl":
            return SteadyrlProtocol(url, self.column)
        if self.protocol == "flow_grpo":
            return FlowGrpoProtocol(url, self.flow_grpo)
        return OpenAIChatProtocol(url, self.judge)


def probe_remote_scorer(spec: HttpRewardSpec) -> None:
    """A `RemoteScorerError` naming the reward and the URL unless a server of its protocol answers there (run
    before Ray starts, so an unreachable URL fails the job before anything is built)."""
    session = HttpSession(spec.url, spec)
    try:
        spec.wire().probe(session)
    except RemoteScorerError as err:
        raise RemoteScorerError(f"reward {spec.name!r} (kind http, {spec.protocol}): {err}") from None
    finally:
        session.close()


class HttpReward(UserRewardModel):
    """The `RewardModel` over a remote scorer (module docstring)."""

    def __init__(self, spec: HttpRewardSpec, text: VerifierReward | None = None):
        self.name, self.spec, self.text = spec.name, spec, text
        self.wire = spec.wire()
        self.session = HttpSession(spec.url, spec)
        self.wire.probe(self.session)

    @classmethod
    def from_spec(cls, spec: HttpRewardSpec) -> "HttpReward":
        text = None if spec.text is None else VerifierReward.from_spec(spec.text)
        try:
            return cls(spec, text)
        except RemoteScorerError as err:
            raise RemoteScorerError(f"reward {spec.name!r} (kind http, {spec.protocol}): {err}") from None

    def items(self, samples: Tensor, cond: Tensor | list[str]) -> Items:
        """The batch as the protocols read it: images (uint8) or decoded completions, with prompts."""
        if self.text is None:
            items = {"samples": list(samples.detach().float().cpu()), "images": to_images(samples, "uint8"),
                     "prompts": to_prompts(cond)}
            if self.spec.metadata:
                table = self.spec.prompt_metadata or {}
                items["metadata"] = [table.get(p, {}) for p in items["prompts"]]
            return items
        return {"completions": [self.text.codec.decode(c) for c in samples],
                "prompts": [self.text.prompt_text(p) for p in cond],
                "answers": [self.text.reference_answer(p) for p in cond]}

    def score(self, samples: Tensor, cond: Tensor | list[str]) -> Tensor:
        return self.score_chunks(self.items(samples, cond), samples.shape[0])

    def score_items(self, prompts: list[str | list[int]], completions: list[str | list[int]]) -> tuple[Tensor, Tensor]:
        """Text or token-id items (the arith REST route): (scores, scores): a remote score is not a verdict."""
        if self.text is None:
            raise ValueError(f"reward {self.name!r} scores images, not text")
        items = {"completions": [x if isinstance(x, str) else self.text.codec.decode(x) for x in completions],
                 "prompts": [x if isinstance(x, str) else self.text.prompt_text(x) for x in prompts],
                 "answers": [self.text.reference_answer(x) for x in prompts]}
        scores = self.score_chunks(items, len(prompts))
        return scores, scores

    def score_chunks(self, items: Items, n: int) -> Tensor:
        """Chunks of `batch_size` (one sample for a judge) posted concurrently; the scores in batch order."""
        size = self.spec.batch_size if self.wire.chunked else 1
        chunks = [{k: v[i:i + size] for k, v in items.items()} for i in range(0, n, size)]
        try:
            replies = self.session.send_all([self.wire.request(c) for c in chunks])
            scores = [s for c, r in zip(chunks, replies) for s in self.chunk_scores(r, c)]
        except RemoteScorerError as err:
            raise RemoteScorerError(f"reward {self.name!r} (kind http, {self.spec.protocol}): {err}") from None
        return as_scores(self.name, self.spec.url, scores, n)

    def chunk_scores(self, reply: Any, chunk: Items) -> list[float]:
        n = len(next(iter(chunk.values())))
        scores = self.wire.scores(reply, n)
        if len(scores) != n:
            raise RemoteScorerError(f"{self.spec.url} returned {len(scores)} scores for {n} samples")
        return scores

    def health_probe(self) -> None:
        """None: the server was probed when this model was built; a step's failure names the URL."""
        return None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the connection pool (which holds the secret); rebuilt on unpickling."""
        return {"spec": self.spec, "text": self.text}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["spec"], state["text"])

