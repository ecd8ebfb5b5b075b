"""Waiting on actor calls, with failures named by the component that failed."""
from __future__ import annotations

import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from steadyrl.services.runtime.driver_bytes import DRIVER_FETCHES
from steadyrl.services.runtime.failures import ComponentFailed  # noqa: F401 - raised here, caught by the controller
from steadyrl.services.runtime.retry import first_line

#: what an actor call fails with when its actor died, hung or could not be reached
ACTOR_FAILURES = (RayActorError, GetTimeoutError)


def wait_all(calls: Sequence[tuple[str, ray.ObjectRef]], timeout_s: float, check: bool = True) -> None:
    """Wait until labelled calls [(component, ref)] are done, without fetching their values. The first failure
    is raised as soon as it is known (when one learner rank dies the others wait in a collective and would
    never return), as `ComponentFailed` naming its component; past `timeout_s` (ray.step_timeout_s) the
    components still pending are named. `check=False` only waits (a failure shows where the value is used):
    for large values, such as weights, that the driver should not fetch. A checked value is fetched into the
    driver here, and counted (`driver_bytes.DRIVER_FETCHES`)."""
    pending = [ref for _, ref in calls]
    label = {ref: component for component, ref in calls}
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()),
                                  fetch_local=False)
        if not ready:
            late = sorted({label[r] for r in pending})
            raise ComponentFailed(" and ".join(late), "timed out", f"no result within {timeout_s:.0f} s, "
                                  "ray.step_timeout_s")
        if not check:
            continue
        try:
            DRIVER_FETCHES.fetched(ray.get(ready))
        except ACTOR_FAILURES as err:
            raise ComponentFailed(label[ready[0]], "died", first_line(err)) from None


def get_all(calls: Sequence[tuple[str, ray.ObjectRef]], timeout_s: float) -> list[Any]:
    """The values of labelled calls [(component, ref)], in order (`wait_all` first: it fetched and counted them,
    this `ray.get` finds them in the driver already)."""
    wait_all(calls, timeout_s)
    return ray.get([ref for _, ref in calls])
