"""d1's token-level GRPO on masked-diffusion LMs (diffu-GRPO, Zhao et al. 2025, github dllm-reasoning/d1): the
baseline the dLLM RL papers (SPG, StableDRL, BGPO) compare against, named apart from the sequence-ratio `grpo`.

Per MC sample j (d1: one per policy iteration, the one-step estimator: the whole completion masked, the prompt
with probability p), for each scored token t of completion i (the positions up to the first EOS, `m_it`):

    A_i      = r_i - mean_g r                                         no std scaling (d1's default)
    rho_it   = exp(log pi_theta(y_it | masked x) - log pi_old(y_it | masked x))        per-token ratio
    l_it     = -min(rho_it A_i, clip(rho_it, 1 - eps, 1 + eps) A_i) + beta (e^{d_it} - d_it - 1),
               d_it = log pi_ref(y_it) - log pi_theta(y_it)                           k3 KL per token
    L_piece  = sum_{i,t} l_it m_it / sum_{i,t} m_it                   a token mean over the micro-batch
               (a piece split to fit memory: each part's sum over the whole piece's token count and rows)

eps = 0.5 and beta = 0.04 are d1's GSM8K settings. The learner's pieces are (micro-batch, MC sample); each
piece's token mean is weighted by its share of the step's terms (b / n_terms), so the step's loss is the mean
of the pieces' token means, as d1's gradient accumulation averages its micro-batches' means.
Behaviour weight: multiplies A_i inside both arms of the clip.

Padded prompts: d1's code calls the model with no attention mask (diffu-grpo's `get_logits`, the path of
`_get_per_token_logps`, and `generate`), so its left-padded rows attend to the pad tokens; the per-token
log-probs come from the sampler (`MaskedDiffusionSampler.log_prob`), which masks the pads by default and attends
to them under `sampler.attend_pads: true` (d1's behaviour, for exact reproduction).
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.advantages import batch_advantages
from steadyrl.trainer.objectives.base import PolicyGradientObjective, PolicyGradientSettings, TermInputs, ratio_metrics
from steadyrl.trainer.objectives.grpo import ppo_clip_loss
from steadyrl.trainer.objectives.registry import register


class GRPOD1Settings(PolicyGradientSettings):
    name: Literal["grpo.d1"] = "grpo.d1"
    eps_clip: float = Field(0.5, gt=0, lt=1, description="PPO clip range of the per-token ratio (d1: 0.5)")
    kl_coef: float = Field(0.04, ge=0, description="beta of the per-token k3 KL to the reference (d1: 0.04)")


@register("grpo.d1")
class GRPOD1(PolicyGradientObjective):
    Settings = GRPOD1Settings
    ratio_scope = "term"
    token_level = True

    def advantages(self, batch: RolloutBatch) -> Tensor:
        """A_i = clip(r_i - mean_g r, +-adv_clip) (per_reward weighting: sum_k w_k z_k,i, trainer/advantages.py)."""
        return batch_advantages(batch, None).clamp(-self.cfg.adv_clip, self.cfg.adv_clip)

    def piece_statistics(self, inputs: TermInputs) -> dict[str, Tensor]:
        """The token mean's normalisers: scored tokens sum_{i,t} m_it and rows b of the piece."""
        if inputs.tokens is None:
            raise ValueError("grpo.d1 needs the per-token log-probs of a masked-diffusion sampler (TermInputs.tokens)")
        scored = inputs.tokens.mask
        return {"tokens": scored.sum(), "rows": torch.tensor(len(scored))}

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if inputs.tokens is None or inputs.old_tokens is None:
            raise ValueError("grpo.d1 needs the per-token log-probs of a masked-diffusion sampler (TermInputs.tokens)")
        piece = inputs.piece or self.piece_statistics(inputs)  # the whole piece's, when the learner split it
        new, scored = inputs.tokens.token_logp, inputs.tokens.mask  # mask: the MC sample's positions up to the EOS
        log_ratio = (new - inputs.old_tokens).masked_fill(~scored, 0.0)
        ratio = log_ratio.exp()
        per_token = ppo_clip_loss(ratio, inputs.advantages.unsqueeze(1), self.cfg.eps_clip)
        metrics = ratio_metrics(ratio[scored], log_ratio[scored], self.cfg.eps_clip)
        if inputs.ref_tokens is not None and self.kl_weight > 0:
            d = (inputs.ref_tokens - new).masked_fill(~scored, 0.0)  # unscored tokens: 0, never exp() of garbage
            kl = d.exp() - d - 1
            per_token = per_token + self.kl_weight * kl
            metrics["policy/kl_ref"] = kl.detach()[scored].mean()
        token_sum = (per_token * scored).sum()
        metrics["policy/pg_loss"] = token_sum.detach() / scored.sum().clamp(min=1)
        token_mean = token_sum / piece["tokens"].clamp(min=1)  # / sum_{i,t} m_it of the whole piece
        return token_mean * int(piece["rows"]) / inputs.n_terms, metrics
