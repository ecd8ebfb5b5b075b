"""A value that moves linearly over a run's updates: the seam for scheduled knobs (BGPO's module-scaling strength,
GRPO-Guard's clip range and thresholds).

    v(u) = start + (end - start) * u / T      u < T
    v(u) = end                                u >= T

u: the update's index (0 first, the learner's update count, kept in its checkpoint), T: `total_updates` (the run's
steps unless set: the run config fills every schedule it holds from run.steps, `fill_total_updates`). A schedule
with start == end is a constant and needs no T. What v means (a strength, a factor on a configured value) is said by
the field that holds it.
"""
from __future__ import annotations

from pydantic import BaseModel, Field

from steadyrl.rollout.settings_base import StrictModel


class LinearSchedule(StrictModel):
    start: float = Field(1.0, ge=0, description="the value at update 0")
    end: float = Field(1.0, ge=0, description="the value from update total_updates on")
    total_updates: int | None = Field(None, ge=1, description="updates the schedule spans; None: the run's steps "
                                      "(run.steps)")

    @property
    def constant(self) -> bool:
        return self.start == self.end

    def bounds_error(self, field: str, low: float, high: float, low_open: bool = False) -> str | None:
        """A message naming `field` when start or end lies outside [low, high] ((low, high] with `low_open`)."""
        for key in ("start", "end"):
            v = getattr(self, key)
            if v > high or v < low or (low_open and v == low):
                interval = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
                return f"{field}.{key}={v} must be in {interval}"
        return None


def linear_value(schedule: LinearSchedule, update: int, field: str = "a linear schedule") -> float:
    """v(u) (module docstring); `field` names the schedule in the error for an unset total_updates."""
    if schedule.constant:
        return schedule.start
    if schedule.total_updates is None:
        raise ValueError(f"{field}.total_updates is unset (the run config fills it from run.steps)")
    if update >= schedule.total_updates:
        return schedule.end  # exactly, not start + (end - start) * 1 in floating point
    return schedule.start + (schedule.end - schedule.start) * (update / schedule.total_updates)


def fill_total_updates(model: BaseModel, steps: int, path: str = "") -> list[str]:
    """Set total_updates = `steps` on every non-constant LinearSchedule in `model` (recursively) that has none;
    returns the dotted names of those it set."""
    filled = []
    for name in type(model).model_fields:
        value = getattr(model, name)
        dotted = f"{path}.{name}" if path else name
        if isinstance(value, LinearSchedule):
            if not value.constant and value.total_updates is None:
                value.total_updates = steps
                filled.append(dotted)
        elif isinstance(value, BaseModel):
            filled += fill_total_updates(value, steps, dotted)
    return filled
