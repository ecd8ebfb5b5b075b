"""Which failures of a Ray call are worth retrying, and a bounded retry with backoff.

Retried: the callee's process died or was unreachable (an actor or Serve replica killed, a node lost) and
timeouts. Not retried: an exception the callee's own code raised (bad input, a bug), which would fail again.
"""
from __future__ import annotations

import logging
import time
from typing import Callable, TypeVar

import ray.exceptions as rex
from ray.serve import exceptions as serve_exceptions

log = logging.getLogger(__name__)
T = TypeVar("T")

PROCESS_FAILURES: tuple[type[BaseException], ...] = (
    rex.RayActorError,  # ActorDiedError, ActorUnavailableError
    rex.GetTimeoutError, TimeoutError,
    rex.WorkerCrashedError, rex.NodeDiedError, rex.ObjectLostError, rex.OwnerDiedError,
    serve_exceptions.DeploymentUnavailableError, serve_exceptions.ReplicaUnavailableError,
    serve_exceptions.RequestCancelledError,
)


def is_process_failure(err: BaseException) -> bool:
    """True for a dead/unreachable process or a timeout, also when it reached us wrapped in the error of a
    call in between (the ensemble ingress awaiting a member replica that died)."""
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, PROCESS_FAILURES):
            return True
        if isinstance(err, rex.RayTaskError):
            err = err.cause
        else:
            err = err.__cause__ or err.__context__
        seen += 1
    return False


def first_line(err: BaseException) -> str:
    """`Type: first line of the message`, for a one-line log or error text."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"


def backoff_s(first_s: float, attempt: int) -> float:
    """first_s * 2^attempt, capped at 8 x first_s."""
    return first_s * min(2**attempt, 8)


def with_retries(call: Callable[[], T], retries: int, first_backoff_s: float, what: str,
                 on_retry: Callable[[int, BaseException], None] | None = None) -> T:
    """`call()`, re-run up to `retries` times after a process failure (waiting `backoff_s` before each);
    other errors, and the last failure, propagate."""
    for attempt in range(retries + 1):
        try:
            return call()
        except Exception as err:  # noqa: BLE001 - filtered by is_process_failure
            if attempt == retries or not is_process_failure(err):
                raise
            wait = backoff_s(first_backoff_s, attempt)
            log.warning("%s failed (%s); retry %d/%d in %.1f s", what, first_line(err), attempt + 1, retries, wait)
            if on_retry is not None:
                on_retry(attempt, err)
            time.sleep(wait)
    raise AssertionError("unreachable")
