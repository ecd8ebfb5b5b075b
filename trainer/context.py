"""What one update's passes share (the recompute pre-pass, trainer/recompute.py, and the term producers,
trainer/terms.py): the sampler, the policy engine, its frozen reference, the objective, the trained steps and
the learner's generator."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.sampler import LogProb, Sampler
from steadyrl.trainer.objectives import Objective

DifferentiableReward = Callable[[Tensor, Tensor], Tensor]  # (x_0 [B,...] with grad, cond [B]) -> [B]


@dataclass
class UpdateContext:
    """The learner's parts an update reads; built per update from the learner (`DeepSpeedLearner.context`)."""

    sampler: Sampler
    policy: nn.Module  # the DeepSpeed engine: forward passes with gradients
    reference: nn.Module  # frozen; only ever run without gradients
    objective: Objective
    train_steps: Tensor  # [S] the trained steps (sequence-level samplers: every MC sample)
    generator: torch.Generator  # the learner's, checkpointed: every random draw of an update comes from it
    reward_fn: DifferentiableReward | None = None  # reward back-propagation only

    @property
    def sequence_level(self) -> bool:
        """The sampler's steps are MC samples of one sequence-level likelihood (masked diffusion)."""
        return self.sampler.sequence_level

    @torch.no_grad()
    def reference_log_prob(self, mb: RolloutBatch, step: Tensor) -> LogProb:
        """The reference's log-prob at `step` (no gradient)."""
        return self.sampler.log_prob(self.reference, mb, step)

    def kl_to_reference(self, mb: RolloutBatch, step: Tensor, new: LogProb | None = None,
                        ref: LogProb | None = None) -> Tensor:
        """Per-sample KL of the policy at `step` to the reference's (grad flows through `new`)."""
        if new is None:
            new = self.sampler.log_prob(self.policy, mb, step)
        return self.sampler.kl(new, self.reference_log_prob(mb, step) if ref is None else ref)
