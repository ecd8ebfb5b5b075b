"""The base of every testbed's config section (`testbed:` in a preset, picked by its `name`).

A testbed's section holds only its own settings (model, pre-training, prompts, rewards) and answers the
questions the run's config asks of any testbed: which samplers fit it, how many rollout workers it can
split its prompts over, whether it has a differentiable training reward (for reward back-propagation
objectives such as DRaFT), and its own cross-section checks.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING, Callable, ClassVar

from torch import Tensor

from steadyrl.rollout.settings_base import StrictModel

if TYPE_CHECKING:
    from steadyrl.services.config import TrainConfig


class TestbedSettings(StrictModel):
    """What every testbed section has and answers; each testbed extends it (unknown keys are errors)."""

    __test__ = False  # not a pytest class, whatever its name

    name: str
    #: the `sampler.kind`s that fit this testbed's policy
    sampler_kinds: ClassVar[tuple[str, ...]] = ()
    #: why reward back-propagation objectives cannot train here (None: they can: `differentiable_reward`)
    no_reward_backprop: ClassVar[str | None] = "its training reward is not differentiable"

    @abstractmethod
    def max_workers(self) -> int:
        """Rollout workers this testbed can split one step's prompts over."""

    def check(self, cfg: "TrainConfig") -> None:
        """Checks across sections (raise ValueError naming the fields); none by default."""

    def differentiable_reward(self) -> Callable[[Tensor, Tensor], Tensor]:
        """The training reward as a differentiable function (x_0, cond) -> [B] (reward back-propagation)."""
        raise ValueError(f"testbed {self.name!r}: {self.no_reward_backprop}")
