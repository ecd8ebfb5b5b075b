"""StableDRL, official-code form (JianyuanZhong/StableDRL, networks/llada_svpo.py, `use_snis: true`).

    A_i      = r_i - mean_g r                                     no std division; no clip unless adv_clip is set
    log w_i  = min(log rho_i, log_ratio_cap)                      one-sided: capped above only (log 5 in their code)
    w        = softmax(log w) over the local batch, detached      sum_i w_i = 1
    L        = -sum_i w_i A_i l_i                                  plain sum: no division by batch or length

Images (this file): one sample's "sequence" is the set of trained steps it draws in the optimisation step,
    log rho_i = sum_j (log pi_theta - log pi_old)(step j of sample i)    computed in the no-grad `prepare`
    l_i       = sum_j log pi_theta(step j of sample i)                   with gradient
and the softmax runs over the optimisation step's samples (their code's "local batch": what one rank
holds). Each piece (micro-batch x one trained step) returns -sum_{i in piece} w_i A_i log pi_theta(x_i at
its step) (+ kl_coef * sum KL / n_terms, 0 by default as in their code); the learner's sum over pieces
gives L. Samples are matched across pieces by `TermInputs.rows` (the same in `prepare` and `loss`).
With several learner ranks the softmax runs over every rank's samples of the step (the learner gathers all
ranks' `prepare` pieces); their code's softmax is per rank, which `softmax_over: group` emulates.

dLLMs (a sequence-level sampler; the form their code was written for): l_i is the SPG sandwich
(`trainer.objectives.sandwich`) -- the ELBO (per-sample mean over masked tokens, averaged over MC masks:
the elbo estimator with `logp_reduce: mean`) when A_i > 0 strictly, else eubo_mix * EUBO(eubo_beta) +
(1 - eubo_mix) * ELBO -- and log rho_i = ELBO_new - ELBO_old (their presets draw the masks independently:
`sampler.masks: independent`). The learner's pieces are one MC sample each, with the ELBO and EUBO
linearised so their gradients sum to the sandwich's.

`softmax_over`: `step` normalises w over the optimisation step's samples; `group` within each prompt
group, then averages over the step's groups -- their runs, one prompt group per rank with gradients
averaged across ranks, emulated on one rank.

Normaliser: none, a plain sum -- w sums to 1 over the step's samples, so L is a weighted mean; n_terms
only divides the optional KL. Images: a sample's terms are spread over the pieces that hold its drawn steps.
dLLMs: one piece per MC sample j, valued at the whole J_i with 1/n of its gradient (linearised), so the
pieces' gradients sum to grad L. Behaviour weight: multiplies A_i in the loss; log rho_i, and so w, are the
proximal policy's.
"""
from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.trainer.objectives.base import (KLSettings, PolicyGradientObjective, TermInputs,
                                     kl_penalty, ratio_metrics)
from steadyrl.trainer.advantages import batch_advantages
from steadyrl.trainer.objectives.registry import register
from steadyrl.trainer.objectives.sandwich import eubo_piece, eubo_statistics, sandwich


class StableDRLCodeSettings(KLSettings):
    name: Literal["stabledrl.code"] = "stabledrl.code"
    log_ratio_cap: float = Field(
        math.log(5.0), description="the per-sample log-ratio is capped above (only) at this before the softmax; "
        "their code: log(ais_clip_iw) with ais_clip_iw = 5")
    adv_clip: float | None = Field(
        None, gt=0, description="clip A = r - mean_g r to [-adv_clip, adv_clip]; None (their code): no clip")
    kl_coef: float = Field(0.0, ge=0, description="weight of the analytic Gaussian KL to the reference (their "
                           "code: none)")
    timestep_fraction: float = Field(0.5, gt=0, le=1, description="share of trained steps drawn per sample")
    softmax_over: Literal["step", "group"] = Field(
        "step", description="step: w = softmax over the optimisation step's samples; group: within each prompt "
        "group, averaged over groups (their runs: one group per rank, gradients averaged across ranks)")
    eubo_beta: float = Field(1.5, gt=0, description="dLLMs: the EUBO's power beta (their default 1.5; 1.0 on sudoku)")
    eubo_mix: float = Field(0.5, ge=0, le=1, description="dLLMs: J = mix * EUBO + (1 - mix) * ELBO where A <= 0")


def softmax_weights(capped: Tensor, group: Tensor | None, over: str) -> Tensor:
    """w = softmax(capped) over all rows (`step`), or within each group / number of groups (`group`)."""
    if over == "step" or group is None:
        return torch.softmax(capped, dim=0)
    w = torch.zeros_like(capped)
    present = capped.isfinite()
    groups = group[present].unique()
    for g in groups:
        idx = (group == g) & present
        w[idx] = torch.softmax(capped[idx], dim=0) / len(groups)
    return w


@register("stabledrl.code")
class StableDRLCode(PolicyGradientObjective):
    Settings = StableDRLCodeSettings
    needs_prepare = True

    def advantages(self, batch: RolloutBatch) -> Tensor:
        """A_i = r_i - mean_g r (a per_reward weighting: sum_k w_k z_k,i, trainer/advantages.py), clipped if set."""
        adv = batch_advantages(batch, None)
        clip = self.cfg.adv_clip
        return adv if clip is None else adv.clamp(-clip, clip)

    @torch.no_grad()
    def prepare(self, pieces: list[TermInputs]) -> dict[str, Tensor]:
        """Per-sample log rho_i summed over its trained steps, and w = softmax(min(log rho, cap)) over the step."""
        rows = torch.cat([p.rows for p in pieces])
        log_ratio = torch.cat([p.new_logp - p.old_logp for p in pieces])
        n = int(rows.max()) + 1
        per_sample = torch.zeros(n, dtype=log_ratio.dtype).index_add_(0, rows, log_ratio)
        present = torch.zeros(n, dtype=torch.bool).index_fill_(0, rows, True)
        capped = per_sample.clamp(max=self.cfg.log_ratio_cap).masked_fill(~present, -math.inf)
        group = None
        if all(p.group is not None for p in pieces):
            group = torch.full((n,), -1, dtype=torch.long).index_put_((rows,), torch.cat([p.group for p in pieces]))
        weights = softmax_weights(capped, group, self.cfg.softmax_over)  # a row no piece holds gets weight 0
        stats = {"stabledrl/log_ratio": per_sample, "stabledrl/weights": weights}
        if all(p.tokens is not None for p in pieces):  # dLLM: the EUBO's q and value per sample, for the sandwich
            L = pieces[0].tokens[0].mask.shape[-1]
            q = torch.zeros(n, L, dtype=log_ratio.dtype)
            eubo = torch.zeros(n, dtype=log_ratio.dtype)
            for p in pieces:
                q[p.rows], eubo[p.rows] = eubo_statistics(p.tokens, self.cfg.eubo_beta)
            stats.update({"stabledrl/eubo_q": q, "stabledrl/eubo": eubo})
        return stats

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        if "stabledrl/weights" not in stats or inputs.rows is None:
            raise ValueError("stabledrl.code needs the prepare statistics (stabledrl/weights) and TermInputs.rows")
        w = stats["stabledrl/weights"][inputs.rows]
        adv = inputs.advantages
        objective = inputs.new_logp
        if inputs.tokens is not None:  # dLLM: the SPG sandwich (module docstring)
            scale = inputs.tokens.lengths.to(inputs.new_logp.dtype) if inputs.reduce == "sum" else 1.0  # L_V
            q = stats["stabledrl/eubo_q"][inputs.rows]
            n_mc = int(inputs.micro.old_logp.shape[1]) if inputs.micro is not None else 1
            eubo = scale * eubo_piece(inputs.tokens, q, stats["stabledrl/eubo"][inputs.rows], self.cfg.eubo_beta, n_mc)
            objective = sandwich(inputs.new_logp, eubo, adv, self.cfg.eubo_mix)
        pg = -(w * adv * objective).sum()  # plain sum: w sums to 1 over the step's samples
        step_log_ratio = inputs.new_logp - inputs.old_logp
        metrics = ratio_metrics(step_log_ratio.exp(), step_log_ratio, None)
        seq = stats["stabledrl/log_ratio"]
        metrics.update({
            "stabledrl/weight_max": stats["stabledrl/weights"].max(),
            "stabledrl/iw_mean": seq.exp().mean(),  # their iw_mean / iw_max: of the uncapped weights
            "stabledrl/iw_max": seq.exp().max(),
            "stabledrl/cap_frac": (seq > self.cfg.log_ratio_cap).float().mean(),
            "policy/pg_loss": -(w * adv).sum().detach(),
        })
        return pg + kl_penalty(inputs, self.kl_weight, metrics), metrics
