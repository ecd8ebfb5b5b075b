"""The objective registry and the inputs every per-step loss receives."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from torch import Tensor

from rollout.batch import RolloutBatch
from trainer.config import ObjectiveConfig


@dataclass
class StepInputs:
    """What a per-step loss sees for one micro-batch at one sampled step per sample."""

    new_logp: Tensor  # [b] with grad
    old_logp: Tensor  # [b] recomputed at the start of the update, no grad
    advantages: Tensor  # [b]
    kl_ref: Tensor | None = None  # [b] analytic KL to the reference (with grad), when kl_coef > 0
    extras: dict[str, Tensor] = field(default_factory=dict)


class Objective(Protocol):
    """advantages(batch, cfg, state) -> [B];  loss(inputs, cfg, state) -> (scalar loss, metrics)."""

    name: str

    def advantages(self, batch: RolloutBatch, cfg: ObjectiveConfig, state: dict[str, Any]) -> Tensor: ...

    def loss(self, inputs: StepInputs, cfg: ObjectiveConfig, state: dict[str, Any]) -> tuple[Tensor, dict[str, Tensor]]: ...


_REGISTRY: dict[str, Objective] = {}


def register(name: str) -> Callable[[type], type]:
    def deco(cls: type) -> type:
        if name in _REGISTRY:
            raise ValueError(f"objective {name!r} registered twice")
        obj = cls()
        obj.name = name
        _REGISTRY[name] = obj
        return cls

    return deco


def get_objective(name: str) -> Objective:
    if name not in _REGISTRY:
        raise ValueError(f"objective.name={name!r} is not registered; available: {sorted(_REGISTRY)}")
    return _REGISTRY[name]


def available() -> list[str]:
    return sorted(_REGISTRY)
