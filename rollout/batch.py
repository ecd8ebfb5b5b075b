"""`RolloutBatch`: the one type that carries a rollout from sampler to reward to learner."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

COND_PREFIX = "cond."  # extras holding the model's conditioning (text embeddings), one row per sample
POLICY_VERSION = "policy_version"  # extras: [B] updates the sampling (behaviour) policy had had (async rollouts)
BEHAVIOUR_TOKEN_LOGP = "behaviour_token_logp"  # extras [B, L]: a language model's per-token log-probs as sampled
BEHAVIOUR_ENGINE = "behaviour_engine"  # extras [B] bool: sampled by an inference engine with numerics of its own
COMMIT_LOGP = "commit_logp"  # extras [B, L]: block diffusion's confidence in each committed token (not a likelihood)


def cond_extras(inputs: dict[str, Tensor]) -> dict[str, Tensor]:
    """Per-sample model inputs as batch extras (`cond.<name>`); `RolloutBatch.model_cond` reads them back."""
    return {COND_PREFIX + k: v for k, v in inputs.items()}


# Fields indexed by sample (first dimension = batch); everything else is shared by the batch.
PER_SAMPLE_FIELDS = (
    "cond", "group", "samples", "traj", "old_logp",
    "rewards", "advantages", "uncertainty", "features",
)


@dataclass
class RolloutBatch:
    """A batch of sampled trajectories.

    cond [B]: class or prompt ids, or [B,P] prompt token ids (dLLMs); text-to-image models are conditioned on
    embeddings that travel as extras `cond.<name>` (`model_cond`).  group [B]: prompt group (GRPO statistics are
    taken within it).  samples [B,...]: final samples x_0 (dLLMs: completion token ids [B,L]).
    traj [B,T+1,...]: x_T ... x_0 (one latent per inference step; dLLMs: the completion only, [B,1,L]).
    old_logp [B,T]: log pi_old(x_{t_prev} | x_t) per step (0 where the step is not stochastic); dLLMs: the
    likelihood estimate under each of T MC mask samples (the masks are extras `mc_masks`, `prompt_masks`).
    timesteps [T]: model timesteps per inference step (dLLMs: MC sample index).  trainable [T]: step is
    stochastic (sigma >= 1e-3).
    rewards [B,K] with reward_names [K]; the column named `reward_key` is the training reward.
    extras: per-sample tensors ([B,...]: gates, masks, behaviour log-probs, policy version, ...) that
    `index`, `split`, `concat` and `to` carry like the named fields, so none falls out of a micro-batch.
    """

    cond: Tensor
    group: Tensor
    samples: Tensor
    traj: Tensor
    old_logp: Tensor
    timesteps: Tensor
    trainable: Tensor
    rewards: Tensor | None = None
    reward_names: list[str] = field(default_factory=list)
    reward_key: str | None = None
    advantages: Tensor | None = None
    uncertainty: Tensor | None = None
    features: Tensor | None = None
    extras: dict[str, Tensor] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in self.extras.items():
            if not isinstance(value, Tensor) or value.dim() == 0 or value.shape[0] != self.cond.shape[0]:
                shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
                raise ValueError(f"extras[{name!r}] must be a per-sample tensor with first dimension "
                                 f"{self.cond.shape[0]}, got {shape}")

    def __len__(self) -> int:
        return int(self.cond.shape[0])

    @property
    def model_cond(self) -> Tensor | dict[str, Tensor]:
        """What the policy is conditioned on: the `cond.<name>` extras as {name: [B,...]} when the batch has
        them (text embeddings), else `cond` (class ids)."""
        inputs = {k[len(COND_PREFIX):]: v for k, v in self.extras.items() if k.startswith(COND_PREFIX)}
        return inputs or self.cond

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.shape[0])

    def replace(self, **changes: Any) -> "RolloutBatch":
        return dataclasses.replace(self, **changes)

    def with_extras(self, **extras: Tensor) -> "RolloutBatch":
        """A copy with these per-sample extras added (or replaced)."""
        return self.replace(extras={**self.extras, **extras})

    def index(self, idx: Tensor | slice | Sequence[int]) -> "RolloutBatch":
        """Select samples; shared fields are kept as they are."""
        if not isinstance(idx, (slice, Tensor)):
            idx = torch.as_tensor(list(idx), dtype=torch.long)
        changes = {
            name: getattr(self, name)[idx]
            for name in PER_SAMPLE_FIELDS
            if getattr(self, name) is not None
        }
        return self.replace(**changes, extras={k: v[idx] for k, v in self.extras.items()})

    def split(self, micro_batch_size: int) -> list["RolloutBatch"]:
        """Consecutive micro-batches of at most `micro_batch_size` samples."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        return [self.index(slice(i, i + micro_batch_size)) for i in range(0, len(self), micro_batch_size)]

    def train_reward(self) -> Tensor:
        """The reward column the policy is trained on ([B])."""
        if self.rewards is None or self.reward_key is None:
            raise ValueError("batch has no rewards yet: score it before training")
        return self.rewards[:, self.reward_names.index(self.reward_key)]

    def to(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> "RolloutBatch":
        """Move floating-point tensors to `dtype`/`device` (integer tensors keep their dtype)."""

        def move(t: Tensor | None) -> Tensor | None:
            if t is None:
                return None
            return t.to(device=device, dtype=dtype if (dtype is not None and t.is_floating_point()) else None)

        names = PER_SAMPLE_FIELDS + ("timesteps", "trainable")
        return self.replace(**{n: move(getattr(self, n)) for n in names},
                            extras={k: move(v) for k, v in self.extras.items()})

    @staticmethod
    def concat(batches: Sequence["RolloutBatch"]) -> "RolloutBatch":
        """Join batches from several workers (shared fields must agree)."""
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        for b in batches[1:]:
            if not torch.equal(b.timesteps, first.timesteps) or b.reward_names != first.reward_names:
                raise ValueError("batches disagree on timesteps or reward names")
            if not torch.equal(b.trainable, first.trainable):
                raise ValueError("batches disagree on their trainable steps (SDE windows of different training "
                                 "steps, sampler.sde_window): train them in separate updates")
        changes = {}
        for name in PER_SAMPLE_FIELDS:
            parts = [getattr(b, name) for b in batches]
            if all(p is None for p in parts):
                continue
            if any(p is None for p in parts):
                raise ValueError(f"field {name!r} is set in some batches and not in others")
            changes[name] = torch.cat(parts)
        keys = set(first.extras)
        if any(set(b.extras) != keys for b in batches[1:]):
            raise ValueError(f"batches disagree on extras: {[sorted(b.extras) for b in batches]}")
        return first.replace(**changes, extras={k: torch.cat([b.extras[k] for b in batches]) for k in sorted(keys)})
