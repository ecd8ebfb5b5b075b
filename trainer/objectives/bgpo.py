"""BGPO, paper form (Boundary-Guided Policy Optimization, arXiv 2510.11683): a linear lower bound of the
MC-estimated ratio objective, one back-propagation per Monte-Carlo sample (memory constant in n).

With n MC samples of the likelihood estimator, delta_j = ell_theta(j) - ell_old(j) on the same mask j,
the exact objective per sequence is A * exp(mean_j delta_j). BGPO replaces it by the bound

    A >= 0:  A * (1 + mean_j delta_j)          (e^x >= 1 + x)
    A <  0:  A * mean_j exp(delta_j)           (Jensen: mean_j e^{delta_j} >= e^{mean_j delta_j})
    L      = -(1/G) sum_i [bound_i]  + kl_coef * mean k3 KL

a sum of per-MC-sample terms g_j, each back-propagated and freed in turn. At theta = theta_old with
shared masks (delta_j = 0) the bound equals the exact objective in value (A) and in gradient
(A * mean_j grad delta_j). No ratio clipping (the paper states none); A is GRPO's group-normalised
advantage. On images each trained step is a term the same way (`ratio_scope = "term"`).

Normaliser: each piece (one MC sample j, or one trained step, per sample) returns -sum_{i in piece} g / n_terms
+ kl_coef * sum KL / n_terms, n_terms = samples in the optimisation step (all ranks) x terms per sample (all n
MC samples on a dLLM; the drawn trained steps on images): the pieces sum to -(1/G) sum_i mean_j g_ij.
Behaviour weight: multiplies A (w > 0 keeps its sign, so the same branch of the bound is taken).
"""
from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from steadyrl.trainer.objectives.base import (PolicyGradientObjective, PolicyGradientSettings, TermInputs, kl_penalty,
                                              ratio_metrics)
from steadyrl.trainer.objectives.registry import register


def bgpo_bound(log_ratio: Tensor, adv: Tensor) -> Tensor:
    """Per-term lower bound g: A (1 + delta) where A >= 0, A exp(delta) where A < 0."""
    return torch.where(adv >= 0, adv * (1 + log_ratio), adv * log_ratio.exp())


class BGPOPaperSettings(PolicyGradientSettings):
    name: Literal["bgpo.paper"] = "bgpo.paper"


@register("bgpo.paper")
class BGPOPaper(PolicyGradientObjective):
    Settings = BGPOPaperSettings
    ratio_scope = "term"

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        log_ratio = inputs.new_logp - inputs.old_logp
        bound = bgpo_bound(log_ratio, inputs.advantages)
        pg = -bound.sum() / inputs.n_terms  # summed over the n MC terms of each sequence: -(1/G) sum_i bound_i
        metrics = ratio_metrics(log_ratio.exp(), log_ratio, None)
        metrics["bgpo/bound_mean"] = bound.detach().mean()
        metrics["policy/pg_loss"] = pg.detach() * inputs.n_terms / len(bound)
        return pg + kl_penalty(inputs, self.kl_weight, metrics), metrics
