"""SIGTERM handled like Ctrl-C: `kill PID`, a process manager or Kubernetes stops a run or `serve-reward`
gracefully (checkpoint kept, Ray and Serve shut down), with the conventional exit status 128 + signal."""
from __future__ import annotations

import signal
import threading
from types import FrameType


class Terminated(KeyboardInterrupt):
    """Raised in the main thread by SIGTERM; caught wherever Ctrl-C (KeyboardInterrupt) is."""

    signum = signal.SIGTERM


def stop_on_sigterm() -> None:
    """Make SIGTERM raise `Terminated` in the main thread. `ray.init` installs its own handler (`sys.exit` from
    inside whatever call is running; the driver then dies by SIGABRT and leaves Ray's agents behind), so this is
    called again right after it. Further SIGTERMs during the shutdown are ignored (SIGKILL still ends it)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)


# Signals are process-wide, and so is this record of one: Ray turns an exception raised while `ray.get` waits
# into a plain KeyboardInterrupt, so the exception alone cannot tell SIGTERM from Ctrl-C.
_received: list[int] = []


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _received.append(signum)
    raise Terminated()


def stop_status(err: BaseException) -> int:
    """Exit status of a process stopped by `err`: 143 after SIGTERM, 130 after Ctrl-C (SIGINT)."""
    terminated = isinstance(err, Terminated) or signal.SIGTERM in _received
    return 128 + int(signal.SIGTERM if terminated else signal.SIGINT)
