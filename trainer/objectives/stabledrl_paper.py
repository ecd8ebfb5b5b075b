"""StableDRL, paper form (arXiv 2603.06743): unconditional clip + self-normalisation by the clipped ratios.

    A_j      = clip((r - mean_g r) / (std_g r + eps_std), -adv_clip, adv_clip)     as GRPO, per sample
    rho_j    = exp(log pi_theta(x_j) - log pi_old(x_j))                            j = one (sample, trained step) term
    c_j      = clip(rho_j, 1 - eps_clip, 1 + eps_clip)                             whatever the sign of A_j; detached
    grad J   = sum_j c_j A_j grad log pi_theta(x_j) / sum_i c_i

Each piece (one micro-batch x one trained step per sample) returns
    L_piece  = -sum_{j in piece} sg(c_j) A_j log pi_theta(x_j) / sg(Z)  +  kl_coef * sum KL / n_terms
and the learner sums the pieces. With eps_clip < 1 every c_j > 0, so the update is a convex combination
of the A_j grad log pi(x_j): its norm is at most max_j |A_j| * ||grad log pi(x_j)||.

`normalise` chooses Z:
  step   Z = sum of c_i over every (sample, trained step) term of the whole optimisation step -- the same
         index set as the numerator. Computed in the no-grad `prepare` pass from the current weights (the
         weights do not move within an optimisation step, so prepare's c_i are the c_j seen by `loss`).
         `prepare` sees every rank's pieces (the learner gathers them), so Z is global.
  local  each piece is self-normalised by its own terms, Z_p = sum_{i in piece} c_i, and weighted by its
         share of the step's terms, b_p / n_terms (b_p = samples in the piece). The step's update is then
         the size-weighted mean of per-piece self-normalised estimates -- still a convex combination, and
         identical to `step` when the step has a single piece. No prepare statistics are used. A piece
         split to fit memory (trainer/memory_split.py) keeps the whole piece's Z_p and b_p in every part.

n_terms = samples in the optimisation step (all ranks) x trained steps drawn per sample (dLLM sequence ratio:
sequences); it weighs `local` pieces and divides the KL. Behaviour weight: multiplies A_j only -- c_j and Z
are the proximal policy's clipped ratios, unweighted.
"""
from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from steadyrl.trainer.objectives.base import (PolicyGradientObjective, PolicyGradientSettings, TermInputs,
                                     kl_penalty, ratio_metrics)
from steadyrl.trainer.objectives.registry import register


class StableDRLPaperSettings(PolicyGradientSettings):
    name: Literal["stabledrl.paper"] = "stabledrl.paper"
    eps_clip: float = Field(
        0.2, gt=0, lt=1,
        description="unconditional clip of the per-step ratio, c = clip(rho, 1-eps_clip, 1+eps_clip) whatever the "
        "sign of A; the clipped ratios are detached weights, so any term's weight is at most (1+eps)/(1-eps) times "
        "another's. Must be < 1 (c > 0 keeps the update a convex combination)")
    normalise: Literal["step", "local"] = Field(
        "step", description="step: divide by the sum of clipped ratios over every (sample, trained step) term of the "
        "optimisation step; local: divide each piece (micro-batch x trained step) by its own sum and weight it by "
        "its share of the step's terms")


def clipped_ratio(new_logp: Tensor, old_logp: Tensor, eps_clip: float) -> Tensor:
    """c = clip(exp(new - old), 1 - eps, 1 + eps), without gradient (inf and 0 ratios clip to the bounds)."""
    return (new_logp.detach() - old_logp).exp().clamp(1 - eps_clip, 1 + eps_clip)


@register("stabledrl.paper")
class StableDRLPaper(PolicyGradientObjective):
    Settings = StableDRLPaperSettings

    @property
    def needs_prepare(self) -> bool:  # type: ignore[override]
        return self.cfg.normalise == "step"

    def piece_statistics(self, inputs: TermInputs) -> dict[str, Tensor]:
        """normalise=local: the piece's Z_p = sum_{i in piece} c_i and its terms b_p."""
        if self.cfg.normalise != "local":
            return {}
        c = clipped_ratio(inputs.new_logp, inputs.old_logp, self.cfg.eps_clip)
        return {"c_sum": c.sum(), "rows": torch.tensor(len(c))}

    @torch.no_grad()
    def prepare(self, pieces: list[TermInputs]) -> dict[str, Tensor]:
        """Z = sum of the clipped ratios over all the step's terms, and their count (both sums: all-reducible)."""
        c = torch.cat([clipped_ratio(p.new_logp, p.old_logp, self.cfg.eps_clip) for p in pieces])
        return {"stabledrl/c_sum": c.sum(), "stabledrl/c_count": torch.tensor(float(len(c)), dtype=c.dtype)}

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = inputs.new_logp - inputs.old_logp
        c = clipped_ratio(inputs.new_logp, inputs.old_logp, self.cfg.eps_clip)
        if self.cfg.normalise == "step":
            if "stabledrl/c_sum" not in stats:
                raise ValueError("stabledrl.paper with normalise=step needs the prepare statistics "
                                 "(stabledrl/c_sum): run `prepare` over the optimisation step first")
            z, count = stats["stabledrl/c_sum"], stats["stabledrl/c_count"]
            weight = c / z  # each term's weight in the step's convex combination: / Z, the step's sum of c
        else:
            piece = inputs.piece or self.piece_statistics(inputs)  # the whole piece's, when the learner split it
            z, count = piece["c_sum"], piece["rows"].to(c.dtype)
            weight = c / z * (int(piece["rows"]) / inputs.n_terms)  # / Z_p, times the piece's share b_p / n_terms
        adv = inputs.advantages
        pg = -(weight * adv * inputs.new_logp).sum()
        metrics = ratio_metrics(log_ratio.exp(), log_ratio, self.cfg.eps_clip)
        metrics["stabledrl/norm"] = z / count
        metrics["stabledrl/weight_max"] = weight.max()
        metrics["policy/pg_loss"] = -(weight * adv).sum().detach()  # the surrogate's value, sum_j w_j A_j
        return pg + kl_penalty(inputs, self.kl_weight, metrics), metrics
