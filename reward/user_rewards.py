"""A user's own rewards as one config type: a function by import path (`kind: python`, the default), a remote
scorer (`kind: http`) or a plug-in package's reward kind (`reward.factory.PLUGIN_SPECS`). The testbeds'
`functions` lists hold these."""
from __future__ import annotations

from typing import Annotated, Any

from pydantic import Discriminator

from steadyrl.reward.factory import PLUGIN_SPECS, tagged_union
from steadyrl.reward.http_reward import HttpRewardSpec
from steadyrl.reward.python_reward import PythonRewardSpec


def _kind(value: Any) -> str | None:
    """`kind`, 'python' when a mapping leaves it out."""
    return value.get("kind", "python") if isinstance(value, dict) else getattr(value, "kind", None)


UserRewardSpec = Annotated[
    tagged_union([PythonRewardSpec, HttpRewardSpec, *PLUGIN_SPECS.values()]),  # type: ignore[valid-type]
    Discriminator(_kind),
]
