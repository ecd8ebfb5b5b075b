"""What stands in front of the REST routes: `RestGuard` (bearer token, body size) and 422s that name fields.

Limits: `serve.max_body_bytes` (413, from Content-Length or while the body streams in, before any JSON is
parsed) and an optional bearer token (`serve.auth_token_env` / `serve.auth_token_file`: 401 without it; only
its SHA-256 reaches the replicas).
"""

import hashlib
import hmac
import json
from typing import Any, Sequence

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from steadyrl.services.serving.schemas import HEALTH_ROUTE, MAX_REPORTED_ERRORS

OPEN_PATHS = frozenset({HEALTH_ROUTE, "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def token_digest(token: str) -> str:
    """SHA-256 hex of a bearer token: what the replicas hold and compare against."""
    return hashlib.sha256(token.encode()).hexdigest()


async def _reply(send: Any, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class RestGuard:
    """ASGI middleware in front of every route: the bearer token (401; OPEN_PATHS need none), then the body
    size (413, from Content-Length or counted while the body streams in), both before any JSON is parsed."""

    def __init__(self, app: Any, max_body_bytes: int, token_sha256: str | None = None):
        self.app, self.max_body_bytes, self.token_sha256 = app, max_body_bytes, token_sha256

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token_digest(token.strip()), self.token_sha256)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path
        headers = dict(scope["headers"])
        if self.token_sha256 is not None and path not in OPEN_PATHS and not self._authorized(headers):
            return await _reply(send, 401, "missing or wrong bearer token: send `Authorization: Bearer <token>`",
                                [(b"www-authenticate", b"Bearer")])
        limit = f"the request body limit is {self.max_body_bytes} bytes (serve.max_body_bytes)"
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                return await _reply(send, 400, "Content-Length is not a number")
            if int(length) > self.max_body_bytes:
                return await _reply(send, 413, f"body of {int(length)} bytes: {limit}")
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                return await _reply(send, 413, f"body over {self.max_body_bytes} bytes: {limit}")
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for a disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        return await self.app(scope, replay, send)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 naming each bad field (`loc`), without the input: pydantic's default echoes it, and a NaN from JSON's
    non-standard literal cannot be encoded back (it was a 500), a 20,000-sample body should not return."""
    errors = exc.errors()
    detail = [{"loc": [p if isinstance(p, (str, int)) else str(p) for p in e["loc"]], "msg": str(e["msg"]),
               "type": str(e["type"])} for e in errors[:MAX_REPORTED_ERRORS]]
    if len(errors) > MAX_REPORTED_ERRORS:
        detail.append({"loc": ["body"], "msg": f"... and {len(errors) - MAX_REPORTED_ERRORS} more errors",
                       "type": "too_many_errors"})
    return JSONResponse(status_code=422, content={"detail": detail})
