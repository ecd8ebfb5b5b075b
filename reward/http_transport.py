"""How a remote scorer's requests travel: a timeout, bounded concurrency, retries with backoff, an auth header.

    retried       connection errors, timeouts, and replies 5xx (the server or a proxy in front of it failed)
    not retried   replies 4xx (the request is wrong: sending it again gives the same answer)
    wait before retry k (k = 1, 2, ...):   backoff_s * 2**(k - 1)

A server that stays down is a `RemoteScorerError` naming the URL, the attempts and the last failure. The auth
header's value is read once, from an environment variable or a file, and never appears in an error or a log.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import httpx
from pydantic import Field, model_validator

from steadyrl.rollout.settings_base import StrictModel


class RemoteScorerError(RuntimeError):
    """A remote scorer could not be reached, refused a request, or replied outside its protocol."""


class HttpAuth(StrictModel):
    """Where the auth header's secret comes from: an environment variable or a file (never the config itself,
    which is copied into the run folder)."""

    env: str | None = Field(None, description="environment variable that holds the secret (read where the scorer "
                            "runs: a Serve replica inherits the job's environment)")
    file: str | None = Field(None, description="file whose content (stripped) is the secret, e.g. a mounted "
                             "Kubernetes secret")
    header: str = Field("Authorization", description="the header that carries it")
    scheme: str = Field("Bearer", description="written before the secret ('Bearer <secret>'); '' sends it bare, "
                        "as an x-api-key header wants")

    @model_validator(mode="after")
    def _one_source(self) -> "HttpAuth":
        if (self.env is None) == (self.file is None):
            raise ValueError("auth: give exactly one of env (an environment variable) or file (a path)")
        return self

    def header_value(self) -> str:
        """'<scheme> <secret>'; a `RemoteScorerError` naming the variable or file (never the secret) if unset."""
        if self.env is not None:
            secret = os.environ.get(self.env)
            if not secret:
                raise RemoteScorerError(f"auth.env={self.env!r}: the environment variable is not set")
        else:
            path = Path(self.file).expanduser()
            if not path.is_file():
                raise RemoteScorerError(f"auth.file={self.file!r}: no such file")
            secret = path.read_text().strip()
        return f"{self.scheme} {secret}".strip()


class HttpTransport(StrictModel):
    """Timeout, concurrency and retry settings of a remote scorer."""

    timeout_s: float = Field(60.0, gt=0, description="per request: a judge model on a busy GPU can take tens of "
                             "seconds for a batch; a hung server then fails the step instead of stalling it")
    max_concurrency: int = Field(4, ge=1, description="requests in flight at once: a batch is split into "
                                 "`batch_size` chunks posted in parallel, bounded so one trainer cannot flood a "
                                 "shared scorer")
    retries: int = Field(3, ge=0, description="further attempts after a connection error, timeout or 5xx reply "
                         "(never after a 4xx: the same request would be refused again)")
    backoff_s: float = Field(0.5, ge=0, description="wait before the first retry, doubled for each further one: "
                             "a restarting server gets time to come back")
    auth: HttpAuth | None = Field(None, description="an auth header from an environment variable or a file")


Response = httpx.Response


@dataclass(frozen=True)
class Request:
    """One HTTP request: method, URL and httpx's keyword arguments (json=, content=)."""

    method: str
    url: str
    body: dict[str, Any] = field(default_factory=dict)


class HttpSession:
    """One scorer's connection pool: `post_all` sends requests with the transport's rules (module docstring)."""

    def __init__(self, url: str, transport: HttpTransport):
        self.url, self.transport = url, transport
        headers = {} if transport.auth is None else {transport.auth.header: transport.auth.header_value()}
        limits = httpx.Limits(max_connections=transport.max_concurrency)
        self.client = httpx.Client(headers=headers, timeout=transport.timeout_s, limits=limits)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an HttpSession holds open connections and a secret: build one where it is used")

    def send(self, request: Request, any_reply: bool = False) -> Response:
        """One request with retries; the successful reply, or a `RemoteScorerError` naming its URL (`any_reply`:
        a 4xx reply is returned too, for probes that only ask whether something answers)."""
        attempts, last = self.transport.retries + 1, ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.transport.backoff_s * 2 ** (attempt - 1))
            try:
                reply = self.client.request(request.method, request.url, **request.body)
            except httpx.TransportError as err:  # refused, reset, timed out: worth another try
                last = f"{type(err).__name__}: {err}"
                continue
            if reply.status_code >= 500:
                last = f"HTTP {reply.status_code}: {_short(reply.text)}"
                continue
            if reply.status_code >= 400 and not any_reply:
                raise RemoteScorerError(f"{request.url} refused the request: HTTP {reply.status_code}: "
                                        f"{_short(reply.text)}")
            return reply
        raise RemoteScorerError(f"{request.url} did not answer after {attempts} attempts (last: {last})")

    def send_all(self, requests: Sequence[Request]) -> list[Response]:
        """The replies in order, at most `max_concurrency` requests in flight."""
        if len(requests) == 1:
            return [self.send(requests[0])]
        with ThreadPoolExecutor(max_workers=min(self.transport.max_concurrency, len(requests))) as pool:
            return list(pool.map(self.send, requests))

    def close(self) -> None:
        self.client.close()


def _short(text: str, limit: int = 300) -> str:
    """A reply's body cut for an error message."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."
