"""Which update path an objective takes on a sampler: one check, run by the config before anything starts and by
the learner when it picks its term producer (trainer/terms.py `PRODUCERS`).

An objective declares its path (`Objective.update_path`) and what its ratios need (`ratio_scope`, `token_level`,
`needs_old_mean`); a sampler's settings say what its steps are (`sequence_level`, `prediction`,
`redraws_token_masks`, `num_steps`). Both are known from the settings alone:

    objective's path   the sampler it needs                                      producer
    forward_process    a velocity (rectified-flow) model: sampler.kind flow_sde  forward_process   (DiffusionNFT)
    reward_backprop    Gaussian steps, 1 <= backprop_steps <= num_steps          reward_backprop   (DRaFT-K)
    policy_gradient    Gaussian steps (images)                                   per_step
    policy_gradient    sequence-level (language models), ratio_scope "sequence"  sequence
    policy_gradient    sequence-level, ratio_scope "term"                        per_step          (BGPO's bound, d1)
"""
from __future__ import annotations

from typing import Literal

from steadyrl.rollout.config import SamplerBase
from steadyrl.trainer.objectives.base import Objective, ObjectiveSettings

Producer = Literal["per_step", "sequence", "reward_backprop", "forward_process"]


def update_path(objective: type[Objective], settings: ObjectiveSettings, sampler: SamplerBase) -> Producer:
    """The producer of `objective`'s terms on `sampler` (module table); a ValueError naming the settings where they
    do not fit."""
    name = settings.name
    if settings.entropy_coef > 0 and not sampler.sequence_level:
        raise ValueError(f"objective.entropy_coef={settings.entropy_coef}: the entropy bonus is over a language "
                         f"model's token distribution; sampler.kind={sampler.kind!r} samples images")
    if objective.update_path == "forward_process":
        if sampler.prediction != "velocity":
            raise ValueError(f"objective.name={name!r} trains a velocity (rectified-flow) model on its clean samples "
                             f"re-noised: it needs sampler.kind='flow_sde', not sampler.kind={sampler.kind!r}")
        return "forward_process"
    if objective.update_path == "reward_backprop":
        k = settings.backprop_steps  # type: ignore[attr-defined]  # RewardBackpropSettings
        if not 1 <= k <= sampler.num_steps:
            raise ValueError(f"objective.backprop_steps={k} must be in [1, {sampler.num_steps}] (sampler.num_steps)")
        if sampler.sequence_level:
            raise ValueError(f"objective {name!r} re-runs Gaussian sampling steps: it does not apply to "
                             f"sampler.kind={sampler.kind!r}")
        return "reward_backprop"
    if objective.token_level and not (sampler.sequence_level and objective.ratio_scope == "term"):
        raise ValueError(f"objective {name!r} takes per-token ratios of a masked-diffusion LM: it does not apply to "
                         f"sampler.kind={sampler.kind!r}")
    if objective.token_level and sampler.redraws_token_masks:
        raise ValueError(f"objective {name!r} compares each token's old and new log-probs, so both must mask the same "
                         "completion positions: sampler.masks=shared, or sampler.estimator=one_step (every position "
                         "masked; independent masks then redraw only the prompt's)")
    if not sampler.sequence_level:
        return "per_step"
    if objective.needs_old_mean:
        raise ValueError(f"objective {name!r} needs Gaussian step means: it does not apply to "
                         f"sampler.kind={sampler.kind!r}")
    return "sequence" if objective.ratio_scope == "sequence" else "per_step"
