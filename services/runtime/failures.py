"""A component of a run that failed (Ray-free: the controller catches it whichever runtime raised it)."""
from __future__ import annotations


class ComponentFailed(RuntimeError):
    """`component` (e.g. "the learner", "rollout worker 1") `what` ("died", "timed out", ...), `cause` the error."""

    def __init__(self, component: str, what: str, cause: str):
        super().__init__(f"{component} {what} ({cause})")
        self.component, self.what, self.cause = component, what, cause

    def during(self, step: int) -> str:
        """'the learner died during step 5 (cause)'."""
        return f"{self.component} {self.what} during step {step} ({self.cause})"
