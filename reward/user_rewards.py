"""A user's own rewards as one config type: a function by import path (`kind: python`, the default) or a remote
scorer (`kind: http`). The testbeds' `functions` lists hold these."""
from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Discriminator, Tag

from steadyrl.reward.http_reward import HttpRewardSpec
from steadyrl.reward.python_reward import PythonRewardSpec


def _kind(value: Any) -> str | None:
    """`kind`, 'python' when a mapping leaves it out."""
    return value.get("kind", "python") if isinstance(value, dict) else getattr(value, "kind", None)


UserRewardSpec = Annotated[
    Union[Annotated[PythonRewardSpec, Tag("python")], Annotated[HttpRewardSpec, Tag("http")]],
    Discriminator(_kind),
]
