"""What stands in front of the REST routes: `RestGuard`, the gate every request passes before any JSON is
parsed, and `RestSettings`, the limits it enforces.

In order: the bearer token (401; only its SHA-256 reaches the replicas), the content type (415 unless JSON),
Content-Length (400 if not a number, 413 past `serve.max_body_bytes`), then the body, read against slow clients
(`uploads`: 408 past `serve.body_timeout_s` or `serve.body_idle_timeout_s`, or for the most idle of
`serve.max_unfinished_bodies` uploads when a new one needs its slot; 413 past the limit while it streams).
"""

import hmac
import json
from dataclasses import dataclass
from typing import Any, Sequence

from steadyrl.services.config import ServeConfig, token_digest
from steadyrl.services.serving.schemas import HEALTH_ROUTE
from steadyrl.services.serving.uploads import BodyRefused, ClientGone, UploadSlots, read_body

OPEN_PATHS = frozenset({HEALTH_ROUTE, "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})
JSON_TYPES = ("application/json",)  # and any application/*+json


@dataclass(frozen=True)
class RestSettings:
    """What the ingress's REST app needs from `ServeConfig` (the token only as its SHA-256)."""

    max_samples: int = 256
    max_body_bytes: int = 16 * 2**20
    token_sha256: str | None = None
    body_timeout_s: float = 30.0
    body_idle_timeout_s: float = 5.0
    upload_slots: int = 16

    @classmethod
    def from_config(cls, cfg: ServeConfig) -> "RestSettings":
        return cls(cfg.max_request_samples, cfg.max_body_bytes, cfg.token_sha256(), cfg.body_timeout_s,
                   cfg.body_idle_timeout_s, cfg.upload_slots())


async def _reply(send: Any, status: int, detail: str, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def _announces_body(headers: dict[bytes, bytes]) -> bool:
    return headers.get(b"content-length", b"0") != b"0" or b"transfer-encoding" in headers


def _is_json(content_type: bytes) -> bool:
    media = content_type.decode("latin-1").split(";")[0].strip().lower()
    return media in JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


class RestGuard:
    """ASGI middleware in front of every route (see the module's docstring for what it checks, in order).
    OPEN_PATHS (/healthz, the docs) need no token; requests without a body never take an upload slot."""

    def __init__(self, app: Any, settings: RestSettings):
        self.app, self.settings = app, settings
        self.uploads = UploadSlots(settings.upload_slots)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token_digest(token.strip()),
                                                                  self.settings.token_sha256)

    def _refusal(self, path: str, headers: dict[bytes, bytes],
                 has_body: bool) -> tuple[int, str, list[tuple[bytes, bytes]]] | None:
        """What to answer before reading the body, or None to read it."""
        s = self.settings
        if s.token_sha256 is not None and path not in OPEN_PATHS and not self._authorized(headers):
            return 401, "missing or wrong bearer token: send `Authorization: Bearer <token>`", [
                (b"www-authenticate", b"Bearer")]
        length = headers.get(b"content-length")
        if has_body and not _is_json(headers.get(b"content-type", b"")):
            got = headers.get(b"content-type", b"").decode("latin-1")[:60] or "none"
            return 415, f"send the body as JSON with `Content-Type: application/json` (got {got})", []
        if length is not None:
            if not length.isdigit():
                return 400, "Content-Length is not a number", []
            if int(length) > s.max_body_bytes:
                return 413, (f"body of {int(length)} bytes: the request body limit is {s.max_body_bytes} bytes "
                             "(serve.max_body_bytes)"), []
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, root = scope["path"], scope.get("root_path", "")
        path = path[len(root):] if root and path.startswith(root) else path
        headers = dict(scope["headers"])
        has_body = _announces_body(headers)
        # a reply before the whole body was read closes the connection: nothing is left waiting on the rest
        close = [(b"connection", b"close")] if has_body else []
        refusal = self._refusal(path, headers, has_body)
        if refusal is not None:
            status, detail, extra = refusal
            return await _reply(send, status, detail, [*extra, *close])
        s = self.settings
        upload = None
        try:
            upload = self.uploads.admit() if has_body else None
            body = await read_body(receive, upload, s.max_body_bytes, s.body_timeout_s, s.body_idle_timeout_s)
        except BodyRefused as refused:
            return await _reply(send, refused.status, refused.detail, close)
        except ClientGone:
            return None
        finally:
            if upload is not None:
                self.uploads.release(upload)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: wait for a disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return await self.app(scope, replay, send)
