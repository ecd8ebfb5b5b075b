"""What every settings section of every part shares: strict pydantic models, and the error a bad config raises.

It sits on the lowest floor (rollout/), so the libraries, the testbeds and the job config all reach it without
importing one another.
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A bad config file, key or value; the message names the field."""


class StrictModel(BaseModel):
    """Base for all settings: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
