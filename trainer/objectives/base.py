"""What every objective shares: its settings base, the inputs it sees (`TermInputs`), and its lifecycle.

One update (an RL step) of the learner, as the objective sees it:

    obj.begin_update(UpdateSchedule(u, kl_scale))  # this update's index u and the KL schedule's factor
    batch, m = obj.prepare_batch(batch)            # once, whole batch: advantages, gates, weights
    for each optimisation step (optim_batch_size samples, several micro-batches):
        stats = obj.prepare(pieces)                # no grad: whole-step normalisers, per-step stats
        for each piece (micro-batch x trained step; see trainer/terms.py for each update path):
            loss, m = obj.piece_loss(inputs, stats)  # this piece's share of the step's loss (`loss` - entropy bonus)
            backward(loss)
        obj.regulate_gradients(network)            # in place, on the step's parameter gradients (default: none)
        optimiser step
    m = obj.after_update(hooks)                    # reference reset / EMA, adaptive constants

Losses are sums with explicit normalisers: `loss` returns this piece's contribution to the
optimisation step's objective (e.g. sum over the piece / `inputs.n_terms`), and the learner adds
the pieces without rescaling them. `n_terms` counts the step's terms on every rank: samples x trained
steps per sample (per-step path), sequences (sequence path), samples (reward back-propagation).

Behaviour weights (asynchronous rollouts, trainer/off_policy.py) reach an objective only through
`inputs.advantages`, already multiplied by min(pi_prox / pi_b, cap) for lagged samples (1 otherwise);
ratios, clips and normalisers are the proximal policy's. Each objective's docstring says where its
advantage enters.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal, Protocol

import torch
from pydantic import Field, model_validator
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.likelihood import SequenceLogProb
from steadyrl.rollout.settings_base import StrictModel
from steadyrl.trainer.advantages import batch_advantages


class ObjectiveSettings(StrictModel):
    """Settings every objective has. Each objective extends this with its own (unknown keys are errors)."""

    name: str
    train_min_std: float = Field(
        0.0, ge=0,
        description="train only steps whose std is at least this (0: every stochastic step, as DDPO). The "
        "per-step score (x_prev - mu)/sigma^2 scales as 1/sigma, so a near-deterministic step (sigma ~ 0.006 "
        "for the digits DDIM schedule) swamps the gradient; the GRPO presets set 0.05.")
    entropy_coef: float = Field(
        0.0, ge=0, le=1,
        description="language models only: loss -= entropy_coef * H, H the mean per-token entropy of the policy's "
        "token distribution at the scored positions (0: off; the seed uses 0.01-0.05): keeps a policy from "
        "collapsing onto one answer before the reward has been explored")

    #: the objective can train a language model (a sequence-level sampler); image-only objectives set False
    language_models: ClassVar[bool] = True

    @property
    def reference_kl_coef(self) -> float:
        """The weight of the objective's KL term to the frozen reference, before schedules (0: it has none)."""
        return 0.0

    def zero_partition_refusal(self) -> str | None:
        """Why these settings need every parameter's whole gradient on one rank (learner.zero_stage=0), naming the
        setting; None: any ZeRO stage will do."""
        return None

    @model_validator(mode="after")
    def _entropy_needs_a_language_model(self) -> "ObjectiveSettings":
        if self.entropy_coef > 0 and not self.language_models:
            raise ValueError(f"objective.entropy_coef={self.entropy_coef}: objective {self.name!r} trains image "
                             "models only, and the entropy bonus is over a language model's token distribution")
        return self


class KLSettings(ObjectiveSettings):
    """Settings of an objective with a KL term to the frozen reference (`kl_coef`; each redefines its default)."""

    kl_coef: float = Field(0.0, ge=0, description="weight of the KL term to the reference")

    @property
    def reference_kl_coef(self) -> float:
        return self.kl_coef


class PolicyGradientSettings(KLSettings):
    """Settings of the per-step likelihood-ratio objectives. `eps_std` (advantage normalisation) and
    `eps_clip` (ratio clipping, where an objective clips) are separate on purpose."""

    eps_std: float = Field(1e-4, gt=0, description="A = (r - mean_g r) / (std_g r + eps_std)")
    adv_clip: float = Field(5.0, gt=0, description="advantages clipped to [-adv_clip, adv_clip]")
    kl_coef: float = Field(0.0, ge=0, description="weight of the analytic Gaussian KL to the reference")
    timestep_fraction: float = Field(0.5, gt=0, le=1, description="share of trained steps drawn per sample")


@dataclass(frozen=True)
class UpdateSchedule:
    """What the learner's schedules say of the update under way, given to the objective at its start
    (`Objective.begin_update`)."""

    index: int = 0  # u, the updates done before this one: the clock of the objective's linear schedules
    kl_scale: float = 1.0  # the KL schedule's factor on kl_coef, times the controller's boost (trainer/kl_schedule.py)


@dataclass
class TermInputs:
    """One piece of an optimisation step, as the objective sees it: b samples of a micro-batch, each at one
    trained step (Gaussian samplers), one MC sample or the whole sequence (masked diffusion), or its re-run x_0
    (reward back-propagation). `prepare` gets every piece of the step (every rank's) without gradient; `loss`
    gets one piece with gradient. The update path that produced it (trainer/terms.py) leaves what it does not
    have as None.
    """

    n_terms: int  # terms in the whole optimisation step, every rank's: the normaliser each objective states
    rows: Tensor | None = None  # [b] each sample's index within the optimisation step (all ranks)
    # likelihood-ratio paths (per-step and sequence)
    new_logp: Tensor | None = None  # [b] with grad in `loss`; at the current weights, without grad, in `prepare`
    old_logp: Tensor | None = None  # [b] recomputed without grad at the start of the update (the proximal policy)
    advantages: Tensor | None = None  # [b] times the behaviour weight of lagged samples (recompute.OldPolicy.weighted)
    step: Tensor | None = None  # [b] each term's inference step / MC sample (None: a sequence-path `prepare` piece)
    group: Tensor | None = None  # [b] prompt group of each sample
    kl_ref: Tensor | None = None  # [b] KL(pi_theta || pi_ref) at the term, with grad (`loss`, when requested)
    micro: RolloutBatch | None = None  # the micro-batch (`loss`: extras, features, the number of MC samples)
    reduce: str = "mean"  # the sampler's reduction of log-probs and KLs
    # Gaussian step samplers only
    std: Tensor | None = None  # [b] the step's Gaussian std
    dt: Tensor | None = None  # [b] |Delta t| of the step
    new_mean: Tensor | None = None  # [b,...] the step mean (with grad in `loss`)
    old_mean: Tensor | None = None  # [b,...] recomputed at the start of the update (`needs_old_mean`)
    # masked diffusion, sequence path: the per-token terms (`loss`: this MC sample's, with grad; `prepare`: a list of
    # every MC sample's, without)
    tokens: SequenceLogProb | list[SequenceLogProb] | None = None
    # masked diffusion, token-level objectives (`token_level`): this MC sample's per-token log-probs [b, L] under the
    # old (proximal) policy and, when the reference is needed, the reference (`tokens` holds the new policy's)
    old_tokens: Tensor | None = None
    ref_tokens: Tensor | None = None
    # reward back-propagation only
    sample: Tensor | None = None  # [b,...] x_0 re-run through the last K steps, with grad
    reward_grad: Tensor | None = None  # [b,...] dr/dx_0 of the differentiable reward at x_0
    reward: Tensor | None = None  # [b] r(x_0), without grad
    # language models, with `entropy_coef` > 0 (the `loss` pieces only): each row's mean per-token entropy at this
    # piece's scored positions, with grad (`SequenceLogProb.entropy`), and the count of such row entropies in the
    # whole optimisation step, every rank's (the entropy bonus's normaliser)
    entropy: Tensor | None = None
    entropy_terms: int = 0
    # a piece split to fit memory (trainer/memory_split.py): the unsplit piece's `Objective.piece_statistics`, summed
    # over its parts, so each part normalises as the whole piece does (None: the piece is whole)
    piece: dict[str, Tensor] | None = None
    # forward-process objectives only (DiffusionNFT, `ForwardProcessTerms`): the clean samples x0 [b,...], their grid
    # value t [b] and noised x_t = (1 - t) x0 + t eps, and the velocity there of the policy (with grad), of the old
    # (sampling) policy and of the frozen reference (both without)
    x0: Tensor | None = None
    t: Tensor | None = None
    x_t: Tensor | None = None
    velocity: Tensor | None = None
    old_velocity: Tensor | None = None
    ref_velocity: Tensor | None = None


class LearnerHooks(Protocol):
    """What `after_update` may ask of the learner."""

    def reset_reference(self) -> None:
        """Hard-copy the policy into the reference."""

    def ema_reference(self, decay: float) -> None:
        """ref <- decay * ref + (1 - decay) * policy."""

    def weights(self) -> dict[str, Tensor]:
        """A CPU copy of the policy's trained tensors (the whole network, or its adapters)."""


class Objective(ABC):
    """Base objective: group-relative advantages, no prepare statistics, no reference updates.

    Class attributes say what the learner must compute for it:
      update_path:     "policy_gradient" (log-prob ratios), "reward_backprop" (DRaFT-K) or
                       "forward_process" (DiffusionNFT: velocities at re-noised clean samples); with the
                       sampler's settings it picks the learner's term producer (trainer/update_path.py)
      needs_prepare:   run the no-grad `prepare` pass (new log-probs of the step's terms) per optimiser step
      needs_old_mean:  keep the old policy's step means from the recompute pass
      needs_reference: compute KL(pi_theta || pi_ref) at each term
      ratio_scope:     with a sequence-level sampler (masked diffusion, steps = MC mask samples):
                       "sequence" -- the ratio is exp(mean_j ell_j - mean_j ell_j^old), one per sequence
                       (the learner's two-pass pieces, `trainer.terms.SequenceTerms`); "term" -- each
                       MC sample's own ratio (BGPO's bound). Image samplers are always per step.
      token_level:     (masked diffusion, ratio_scope "term") per-token ratios: the recompute keeps the old
                       policy's per-token log-probs and each piece gets them and the reference's
                       (`TermInputs.old_tokens`, `ref_tokens`) beside the new policy's (`tokens`)
    State lives in `self.state` as tensors and is checkpointed with torch.save.
    """

    name: ClassVar[str]
    Settings: ClassVar[type[ObjectiveSettings]]
    update_path: ClassVar[Literal["policy_gradient", "reward_backprop", "forward_process"]] = "policy_gradient"
    needs_prepare: ClassVar[bool] = False
    needs_old_mean: ClassVar[bool] = False
    ratio_scope: ClassVar[Literal["sequence", "term"]] = "sequence"
    token_level: ClassVar[bool] = False

    def __init__(self, cfg: ObjectiveSettings):
        self.cfg = cfg
        self.state: dict[str, Tensor] = {}
        self.schedule = UpdateSchedule()  # the update under way (`begin_update`)

    def begin_update(self, schedule: UpdateSchedule) -> None:
        """The learner starts an update: its index and KL factor hold until the next `begin_update`."""
        self.schedule = schedule

    @property
    def needs_reference(self) -> bool:
        return self.cfg.reference_kl_coef > 0

    @property
    def kl_weight(self) -> float:
        """This update's KL weight: the settings' kl_coef times the schedule's factor."""
        return self.cfg.reference_kl_coef * self.schedule.kl_scale

    def advantages(self, batch: RolloutBatch) -> Tensor:
        """A_i = clip((r_i - mean_g r) / (std_g r + eps_std), -adv_clip, adv_clip) within each prompt group
        (a per_reward weighting: clip(sum_k w_k z_k,i, ...), trainer/advantages.py)."""
        cfg = self.cfg
        return batch_advantages(batch, cfg.eps_std).clamp(-cfg.adv_clip, cfg.adv_clip)

    def prepare_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """Once per update on the whole batch (before sharding): set advantages and any per-sample extras."""
        return batch.replace(advantages=self.advantages(batch)), {}

    @torch.no_grad()
    def prepare(self, pieces: list[TermInputs]) -> dict[str, Tensor]:
        """No-grad statistics over the whole optimisation step (every rank's pieces, gathered)."""
        return {}

    @abstractmethod
    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """This piece's contribution to the optimisation step's loss, and its metrics."""

    def piece_loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """What the learner back-propagates: `loss` minus the entropy bonus (`entropy_bonus`; 0 when off)."""
        loss, metrics = self.loss(inputs, stats)
        coef = self.cfg.entropy_coef
        if coef <= 0:
            return loss, metrics
        return loss - entropy_bonus(inputs, coef, metrics), metrics

    def piece_statistics(self, inputs: TermInputs) -> dict[str, Tensor]:
        """Sums over a piece's rows that `loss` normalises the piece by (d1's token count, a local self-
        normalisation's sum of clipped ratios), without gradient. Each must be a sum over rows: a piece split to fit
        memory gets their totals over its parts as `inputs.piece`, so its parts' losses sum to the whole piece's.
        `loss` reads `inputs.piece or self.piece_statistics(inputs)`. Default: none."""
        return {}

    def split_refusal(self) -> str | None:
        """Why this objective's pieces cannot be split to fit memory (a statistic over a piece that is not a sum
        over its rows, e.g. one with gradient), naming the setting; None: they can."""
        return None

    def regulate_gradients(self, network: nn.Module) -> None:
        """Called once per optimisation step with the step's accumulated parameter gradients (after the last
        piece's backward, before the learner's clipping, module scaling and optimiser step): an objective may
        rescale them in place (GRPO-Guard's seed form, per UNet block). Default: nothing."""

    def step_done(self) -> None:
        """Called once per optimisation step, after its last piece's loss (GARDO closes its windowed KL). Default:
        nothing."""

    def after_update(self, hooks: LearnerHooks, metrics: dict[str, float]) -> dict[str, float]:
        """After each update: reference resets/EMA, adaptive constants. Returns extra metrics."""
        return {}

    def sampling_state(self, policy: nn.Module) -> dict[str, Tensor] | None:
        """The trained tensors the rollouts sample with where the objective keeps its own sampling policy
        (DiffusionNFT's old copy, keyed as `policy`'s trained tensors); None: the policy being trained."""
        return None

    def state_dict(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self.state.items()}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.state = {k: v.clone() for k, v in state.items()}


class PolicyGradientObjective(Objective):
    """An objective over likelihood ratios: `loss` is called per piece (micro-batch x trained step or MC
    sample), with `new_logp`, `old_logp`, `advantages` and `step` set."""


class RewardBackpropObjective(Objective):
    """Back-propagates a differentiable reward through the last `backprop_steps` sampling steps (DRaFT-K).

    The learner re-runs x_0 with gradients (`inputs.sample`) and takes G = dr/dx_0 (`inputs.reward_grad`);
    `regulate` may rescale G, flattened to [b, D]; `loss` is the surrogate

        L_piece = -sum_{i in piece} <regulate(G)_i, x0_i(theta)> / n_terms,   n_terms = samples in the step

    whose gradient, summed over the step's pieces, is -grad_theta mean_i r(x0_i) when `regulate` is the
    identity. No advantages, so no behaviour weight: a lagged sample is re-run with noise recorded under the
    proximal (current) policy and its reward gradient is taken as it is.
    """

    update_path = "reward_backprop"

    @abstractmethod
    def regulate(self, grad: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The reward gradient to back-propagate ([b, D] -> [b, D]) and metrics."""

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """-sum <regulate(G), x0> / n_terms (class docstring), and the piece's mean reward."""
        x0 = inputs.sample
        flat, metrics = self.regulate(inputs.reward_grad.flatten(1))
        surrogate = -(flat.view_as(x0).detach() * x0).sum() / inputs.n_terms
        metrics["reward/backprop_mean"] = inputs.reward.mean()
        return surrogate, metrics


def kl_penalty(inputs: TermInputs, kl_coef: float, metrics: dict[str, Tensor]) -> Tensor:
    """kl_coef * sum over the piece of KL(pi_theta || pi_ref) / n_terms (0 when off)."""
    if inputs.kl_ref is None or kl_coef <= 0:
        return torch.zeros((), dtype=inputs.new_logp.dtype)
    metrics["policy/kl_ref"] = inputs.kl_ref.detach().mean()
    return kl_coef * inputs.kl_ref.sum() / inputs.n_terms


def entropy_bonus(inputs: TermInputs, coef: float, metrics: dict[str, Tensor]) -> Tensor:
    """coef * sum_{i in piece} H_i / entropy_terms, H_i the row's mean per-token entropy at the piece's scored
    positions: the pieces of an optimisation step sum to coef * (mean of H over its rows and MC samples). Logs the
    piece's mean H as `policy/entropy`."""
    if inputs.entropy is None or inputs.entropy_terms <= 0:
        raise ValueError("objective.entropy_coef > 0 but the update path gave no token entropies (the bonus needs a "
                         "language-model sampler: masked_diffusion, autoregressive or block_diffusion)")
    metrics["policy/entropy"] = inputs.entropy.detach().mean()
    return coef * inputs.entropy.sum() / inputs.entropy_terms


def ratio_metrics(ratio: Tensor, log_ratio: Tensor, eps_clip: float | None) -> dict[str, Tensor]:
    """Ratio mean/std/max, clip fraction (|rho - 1| > eps_clip) and the k3 estimate of KL(old || new)."""
    r = ratio.detach()
    out = {
        "policy/ratio_mean": r.mean(),
        "policy/ratio_std": r.std(unbiased=False),
        "policy/ratio_max": r.max(),
        "policy/approx_kl_old": ((r - 1) - log_ratio.detach()).mean(),
    }
    if eps_clip is not None:
        out["policy/clip_frac"] = ((r - 1).abs() > eps_clip).float().mean()
    return out
