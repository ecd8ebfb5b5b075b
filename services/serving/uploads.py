"""Reading a request body against slow clients: a deadline for the whole body, an idle timeout between its
pieces, and a bounded pool of bodies read at once (`UploadSlots`), so stalled uploads can never take every
working slot of a replica, nor keep a new upload out."""

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

class BodyRefused(Exception):
    """The body was not read: `status` (408, 413) and a `detail` that names the setting."""

    def __init__(self, status: int, detail: str):
        super().__init__(detail)
        self.status, self.detail = status, detail


class ClientGone(Exception):
    """The client disconnected before its body was read."""


@dataclass(eq=False)
class Upload:
    """One body being read: when it last made progress, and whether a newcomer took its slot."""

    last_progress: float = field(default_factory=time.monotonic)
    evicted: asyncio.Event = field(default_factory=asyncio.Event)


class UploadSlots:
    """At most `size` bodies read at once. When all are taken, a newcomer takes the slot of the upload that has
    sent nothing for the longest, which gets a 408. A new upload is thus never refused, and stalled uploads,
    however often they come back, only ever displace each other: an upload that keeps sending is the last to go
    (only `size` uploads all sending more recently than it displace it)."""

    def __init__(self, size: int):
        self.size = size
        self.active: set[Upload] = set()

    def admit(self) -> Upload:
        if len(self.active) >= self.size:
            idlest = min(self.active, key=lambda u: u.last_progress)
            self.release(idlest)
            idlest.evicted.set()
        upload = Upload()
        self.active.add(upload)
        return upload

    def release(self, upload: Upload) -> None:
        self.active.discard(upload)


async def read_body(receive: Callable[[], Awaitable[dict[str, Any]]], upload: Upload | None, max_bytes: int,
                    timeout_s: float, idle_timeout_s: float) -> bytes:
    """The whole body from ASGI `receive`, or `BodyRefused`: 408 when no piece arrives for `idle_timeout_s`,
    the whole takes over `timeout_s`, or a newer upload took this one's slot; 413 past `max_bytes`."""
    body, deadline = bytearray(), time.monotonic() + timeout_s
    evicted = asyncio.ensure_future(upload.evicted.wait()) if upload is not None else None
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise BodyRefused(408, f"the request body took over {timeout_s:g} s to arrive (serve.body_timeout_s)")
            piece = asyncio.ensure_future(receive())
            done, _ = await asyncio.wait({piece, *([evicted] if evicted else [])}, timeout=min(left, idle_timeout_s),
                                         return_when=asyncio.FIRST_COMPLETED)
            if piece not in done:
                piece.cancel()
                if evicted is not None and evicted in done:
                    raise BodyRefused(408, "the request body stalled while newer uploads needed its slot "
                                      "(serve.max_unfinished_bodies)")
                if time.monotonic() >= deadline:
                    continue  # reported as the whole body's deadline above
                raise BodyRefused(408, f"no part of the request body arrived for {idle_timeout_s:g} s "
                                  "(serve.body_idle_timeout_s)")
            message = piece.result()
            if message["type"] != "http.request":
                raise ClientGone()
            body += message.get("body", b"")
            if upload is not None:
                upload.last_progress = time.monotonic()
            if len(body) > max_bytes:
                raise BodyRefused(413, f"body over {max_bytes} bytes: the request body limit is {max_bytes} bytes "
                                  "(serve.max_body_bytes)")
            if not message.get("more_body", False):
                return bytes(body)
    finally:
        if evicted is not None:
            evicted.cancel()
