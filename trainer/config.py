"""Objective and learner settings (each default defined here or in the objective's own file, once)."""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, model_validator

from steadyrl.rollout.settings_base import StrictModel
from steadyrl.trainer.balanced_gradient import BalancedGradientConfig
from steadyrl.trainer.kl_schedule import KLScheduleConfig
from steadyrl.trainer.lr_schedule import LRScheduleConfig
from steadyrl.trainer.objectives import settings_types


DEFAULT_OBJECTIVE = "grpo"


def _objective_name(value: Any) -> str:
    """`name` of an objective section; a section without one is GRPO."""
    default = DEFAULT_OBJECTIVE
    return value.get("name", default) if isinstance(value, dict) else getattr(value, "name", default)


# A discriminated union on `name`: each objective validates only its own keys.
ObjectiveConfig = Annotated[
    Union[tuple(Annotated[settings, Tag(name)] for name, settings in settings_types().items())],  # type: ignore[valid-type]
    Discriminator(_objective_name),
]


class LearnerConfig(StrictModel):
    """DeepSpeed engine settings; ZeRO stage from config, gloo on CPU, NCCL on GPU."""

    lr: float = Field(1e-4, gt=0)
    lr_schedule: LRScheduleConfig = Field(default_factory=LRScheduleConfig,
                                          description="warm-up and decay of lr over the run's updates")
    kl_schedule: KLScheduleConfig = Field(default_factory=KLScheduleConfig,
                                          description="a factor on the objective's kl_coef over the run's updates")
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    group_grad_clip: float | None = Field(
        None, gt=0, description="clip each top-level module's gradient norm to this before the global grad_clip "
        "(None: off): a spike in one block (e.g. a UNet's up-blocks) is held back without shrinking the others' "
        "steps; needs zero_stage 0, where the gradients are on the parameters")
    zero_stage: int = Field(0, ge=0, le=3)
    fused_adam: bool = Field(False, description="DeepSpeed's fused AdamW kernel (CUDA only; compiled with nvcc on "
                             "first use) instead of torch's AdamW: one kernel for every tensor's update on a GPU; "
                             "off by default so that no op is compiled and CPU runs work")
    inner_epochs: int = Field(2, ge=1)
    micro_batch_size: int = Field(32, ge=1, description="samples per forward/backward (memory)")
    optim_batch_size: int | None = Field(
        None, ge=1, description="samples per optimiser step over all ranks (the optimisation batch; a multiple of "
        "micro_batch_size x ranks); None = micro_batch_size x ranks. Whole-step normalisers run over this batch.")
    ranks: int = Field(1, ge=1, description="data-parallel DeepSpeed ranks, one learner actor each in a placement "
                       "group: each trains on its share of the prompt groups and the gradients are all-reduced, so "
                       "a step's update is the 1-rank update of the same batch (to float summation order)")
    backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="collective backend of the ranks; auto: NCCL when DeepSpeed's accelerator is cuda, "
        "else gloo (the CPU)")
    activation_memory_cap_mb: float | None = Field(
        None, gt=0, description="split a piece (micro-batch x trained step) into halves, recursively down to one "
        "sample, when the tensors its forward keeps for the backward pass this many MB, and accumulate the parts: "
        "the step's gradient is unchanged (trainer/memory_split.py). None: off (a real out-of-memory error in a "
        "forward still splits); set it for headroom on a shared accelerator, or to split before an out-of-memory "
        "error in the backward, which cannot be split")
    logp_alarm: float = Field(1e-3, gt=0, description="warn when |recomputed - rollout old logp| exceeds this "
                              "(samples from the current policy; a lagged batch's gap is the lag, not an alarm)")
    old_logp: Literal["auto", "recompute"] = Field(
        "auto", description="where the old policy's log-probs come from: 'recompute' runs the no-grad pre-pass over "
        "every trained step each update; 'auto' runs it every logp_check_every updates and, in between, takes the "
        "rollout's own log-probs for samples of the current policy while the last check found them within "
        "logp_trust_tol of the recompute. The rollout samples with the learner's weights and micro-batching, so on "
        "a Gaussian sampler they are usually the same numbers, and a pre-pass recomputing them is a forward of "
        "every trained step spent on nothing; the periodic check still catches a drift such as a bad weight sync "
        "(figures: docs/benchmarks.md). Lagged or engine samples, and objectives that read the old step means, "
        "per-token terms or recorded noise, are always recomputed")
    logp_check_every: int = Field(10, ge=1, description="old_logp: auto recomputes and compares every this many "
                                  "updates (and every update after a check that failed): a weight sync gone wrong "
                                  "is caught within this many updates")
    logp_trust_tol: float = Field(0.0, ge=0, description="old_logp: auto trusts the rollout's log-probs when the "
                                  "last check's max |recomputed - rollout| is at most this; 0: only when they were "
                                  "bitwise equal, so a trusted update uses the numbers a recompute would give")
    max_staleness: int = Field(0, ge=0, le=4, description="updates a batch's behaviour policy may lag the learner: "
                               "0 = synchronous (every batch sampled with the current weights); 1 = one-step-off-"
                               "policy pipelining (rollouts of step k+1 run while the learner trains on step k: the "
                               "slower of the two sets the pace, not their sum); the importance weight "
                               "pi_prox/pi_behaviour corrects each lagged term (trainer/off_policy.py)")
    behaviour_weight_cap: float = Field(2.0, ge=1.0, description="truncation c of the behaviour importance weight "
                                        "min(pi_prox/pi_b, c), as V-trace truncates: bounds one stale sample's pull")
    balanced: BalancedGradientConfig = Field(
        default_factory=BalancedGradientConfig,
        description="BGPO's seed-form ('balanced gradient') options, each off by default, for any objective")

    @model_validator(mode="after")
    def _multiple(self) -> "LearnerConfig":
        if self.group_grad_clip is not None and self.zero_stage > 0:
            raise ValueError("learner.group_grad_clip needs zero_stage=0 (ZeRO 1-3 partition the gradients: a "
                             "module's norm is not on one rank's parameters)")
        if self.balanced.module_grad_scaling and self.zero_stage > 0:
            raise ValueError("learner.balanced.module_grad_scaling needs zero_stage=0 (ZeRO 1-3 partition the "
                             "gradients: each module's norm is not on one rank's parameters)")
        if self.activation_memory_cap_mb is not None and self.ranks > 1 and self.zero_stage >= 2:
            raise ValueError(f"learner.activation_memory_cap_mb needs zero_stage 0 or 1 with learner.ranks={self.ranks}"
                             f" (zero_stage={self.zero_stage} runs collectives in every pass, and a rank that splits "
                             "a piece alone would run more passes than the others)")
        per_step = self.micro_batch_size * self.ranks
        if self.optim_batch_size is not None and self.optim_batch_size % per_step:
            raise ValueError(f"optim_batch_size={self.optim_batch_size} must be a multiple of "
                             f"micro_batch_size x ranks = {self.micro_batch_size} x {self.ranks}")
        return self

    @property
    def micro_per_optim_step(self) -> int:
        """Micro-batches each rank accumulates per optimiser step."""
        return (self.optim_batch_size or self.micro_batch_size * self.ranks) // (self.micro_batch_size * self.ranks)
