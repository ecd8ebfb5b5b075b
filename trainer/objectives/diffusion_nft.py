"""DiffusionNFT (Zheng et al. 2025, arXiv 2509.16117; NVlabs/DiffusionNFT): forward-process, likelihood-free
training on the final clean samples x0 and their rewards only (no log-probs, no trajectories).

The learner (`trainer.terms.ForwardProcessTerms`) re-noises each x0 at grid values t of the sampler's own steps,
x_t = (1 - t) x0 + t eps, and gives the policy's velocity v_theta (with grad), the old (sampling) policy's v_old and
the frozen reference's v_ref there (both without). With beta = `beta`, both forms use the implicit policies

    v+ = beta v_theta + (1 - beta) v_old          v- = (1 + beta) v_old - beta v_theta

and the optimality r in [0, 1] of each sample; they differ in r's normaliser and in the loss:

- `diffusion_nft.code` (the authors' `scripts/train_nft_sd3.py`, the reference):
      A   = (R - mean_prompt R) / (std_batch R + eps_std)       batch-wide std (their `adv_mode` "all")
      A_c = clamp(A, -c, c),   r = clamp(A_c / (2c) + 1/2, 0, 1)         c = `adv_clip` (5)
      x0hat± = x_t - t v±,   w± = sg(max(mean |x0hat± - x0|, 1e-5))      per sample, over its elements
      L±  = mean (x0hat± - x0)^2 / w±
      loss = mean_terms c (r L+ + (1 - r) L-) / beta + kl_coef mean (v_theta - v_ref)^2
- `diffusion_nft.paper` (the paper's eq.): the same r with the per-prompt std (std_prompt R + eps_std) and
      loss = mean_terms r mean (v+ - v)^2 + (1 - r) mean (v- - v)^2 + kl_coef mean (v_theta - v_ref)^2,
  v = eps - x0 the flow-matching target (recovered as (x_t - x0) / t).

`batch.advantages` holds A_c; `loss` maps it to r. The old policy is the objective's copy of the sampling policy
(`old_network`: the live network called with its own trained tensors, `AdapterReference`): the rollouts sample with
it (`sampling_state`, `sample_with` "old"; theirs switches the transformer to its "old" adapter to sample, and back
to "default" to train and evaluate), it is checkpointed in the objective state and moved after each update by old <-
d old + (1 - d) theta with the authors' linear schedule d(g) = min(max(g - flat, 0) * rate, max) (their
`return_decay`; defaults: `decay_type` 1 of config/nft.py, flat 0, rate 0.001, max 0.5), g = optimiser steps done,
this update's included, as theirs: they move the old model once per epoch, after its last optimizer.step, by d =
return_decay(global_step), global_step += 1 per optimizer.step. g is counted in `step_done` (a step skipped for a
non-finite gradient too, as their GradScaler-skipped steps count) and kept in the objective state, so their flat,
rate and max copy as written whatever the optimiser steps per update (`learner.inner_epochs` x ceil(micro-batches /
`micro_per_optim_step`); their sd3_ocr config: 2 per epoch).
"""
from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Literal

import torch
from pydantic import Field
from torch import Tensor, nn

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.policy import AdapterReference
from steadyrl.trainer.advantages import batch_advantages, centred_rewards, mean_centred_advantages
from steadyrl.trainer.objectives.base import KLSettings, LearnerHooks, Objective, TermInputs
from steadyrl.trainer.objectives.registry import register

OLD = "old."  # prefix of the old policy's tensors in the objective state
STEPS = "optimiser_steps"  # g, the optimiser steps done (their global_step), in the objective state


class DiffusionNFTSettings(KLSettings):
    """Settings of both DiffusionNFT forms (defaults: the authors' config/base.py and config/nft.py)."""

    language_models: ClassVar[bool] = False  # velocities of a rectified-flow image model

    beta: float = Field(1.0, gt=0, description="beta of v+ = beta v_theta + (1 - beta) v_old and v- = (1 + beta) "
                        "v_old - beta v_theta (config/nft.py: 1.0; their OCR preset 0.1)")
    kl_coef: float = Field(1e-4, ge=0, description="weight of mean (v_theta - v_ref)^2 to the frozen reference "
                           "(their train.beta, always on: 1e-4)")
    adv_clip: float = Field(5.0, gt=0, description="c: A clipped to [-c, c], r = clamp(A / (2c) + 1/2, 0, 1); the "
                            "code form also scales its loss by c (their train.adv_clip_max)")
    eps_std: float = Field(1e-4, gt=0, description="A = (R - mean_prompt R) / (std + eps_std)")
    timestep_fraction: float = Field(0.99, gt=0, le=1, description="each sample trains on floor(T x this) of the "
                                     "sampler's T grid values, a random permutation per sample (theirs: 0.99)")
    sample_with: Literal["old", "current"] = Field(
        "old", description="the policy the rollouts sample with: the old (EMA) policy the loss contrasts against, as "
        "the authors' scripts do (set_adapter('old') before sampling), or `current`, the policy being trained (the "
        "on-policy variant: the samples then come from v_theta while the loss's implicit policies mix in v_old)")
    decay_flat: int = Field(0, ge=0, description="old-policy EMA decay d(g) = min(max(g - flat, 0) rate, max), g "
                            "the optimiser steps done (their global_step, so their values copy as written): d = 0 "
                            "(old = policy) until g reaches this")
    decay_rate: float = Field(0.001, ge=0, description="growth of d(g) per optimiser step, not per update (decay_type "
                              "1: 0.001): an update of k optimiser steps moves d by k x this")
    decay_max: float = Field(0.5, ge=0, lt=1, description="cap of d(g) (decay_type 1: 0.5; decay_type 2: 0.999 with "
                             "flat 75, rate 0.0075)")


class DiffusionNFTCodeSettings(DiffusionNFTSettings):
    name: Literal["diffusion_nft.code"] = "diffusion_nft.code"


class DiffusionNFTPaperSettings(DiffusionNFTSettings):
    name: Literal["diffusion_nft.paper"] = "diffusion_nft.paper"


def optimality(clipped: Tensor, clip: float) -> Tensor:
    """r = clamp(A_c / (2c) + 1/2, 0, 1)."""
    return (clipped / (2 * clip) + 0.5).clamp(0, 1)


def old_decay(cfg: DiffusionNFTSettings, g: int) -> float:
    """d(g) = min(max(g - flat, 0) * rate, max), g optimiser steps done (their `return_decay`; 0 before `flat`)."""
    return 0.0 if g < cfg.decay_flat else min((g - cfg.decay_flat) * cfg.decay_rate, cfg.decay_max)


def per_sample_mean(x: Tensor) -> Tensor:
    """Mean over every dimension but the first: [b,...] -> [b]."""
    return x.flatten(1).mean(1)


class DiffusionNFT(Objective):
    """Shared: the old network and its EMA, the advantage, the KL term; subclasses give the normaliser and loss."""

    update_path = "forward_process"
    batch_std: ClassVar[bool]  # the advantage's std over the whole batch (code) or the prompt's (paper)

    def __init__(self, cfg: DiffusionNFTSettings):
        super().__init__(cfg)
        self.old: AdapterReference | None = None
        self.state[STEPS] = torch.tensor(0)
        self.steps_this_update = 0  # optimiser steps of the update in progress (`step_done`)

    def prepare_batch(self, batch: RolloutBatch) -> tuple[RolloutBatch, dict[str, float]]:
        """A_c = clamp((R - mean_prompt R) / (std + eps_std), -c, c), std the batch's (code) or prompt's (paper)."""
        signal, normalised = centred_rewards(batch)  # a per_reward weighting: already centred and scaled
        if normalised or not self.batch_std:
            adv = batch_advantages(batch, self.cfg.eps_std)  # (R - mean_prompt R) / (std_prompt R + eps_std)
        else:  # (R - mean_prompt R) / (std_batch R + eps_std), population std over every sample of the batch
            adv = mean_centred_advantages(signal, batch.group) / (signal.std(unbiased=False) + self.cfg.eps_std)
        adv = adv.clamp(-self.cfg.adv_clip, self.cfg.adv_clip)
        r = optimality(adv, self.cfg.adv_clip)
        return batch.replace(advantages=adv.to(batch.samples.dtype)), {"nft/optimality_mean": float(r.mean())}

    def old_network(self, policy: nn.Module) -> AdapterReference:
        """The old (sampling) policy: built at the first update from the policy's trained tensors (or from a
        checkpoint's, `load_state_dict`), kept in the objective state."""
        if self.old is None:
            self.old = AdapterReference(policy)
            saved = {k[len(OLD):]: v for k, v in self.state.items() if k.startswith(OLD)}
            if saved:
                self.old.load_trainable_state_dict(saved)
        return self.old

    def sampling_state(self, policy: nn.Module) -> dict[str, Tensor] | None:
        """The old policy's tensors (`sample_with` "old"): before the first update the policy's own, after it
        old <- d old + (1 - d) theta; a resumed run's from its checkpoint."""
        return self.old_network(policy).state if self.cfg.sample_with == "old" else None

    def state_dict(self) -> dict[str, Tensor]:
        state = super().state_dict()
        if self.old is not None:
            state.update({OLD + k: v.detach().to("cpu", copy=True) for k, v in self.old.state.items()})
        return state

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        super().load_state_dict(state)
        self.steps_this_update = 0
        if self.old is not None:
            self.old.load_trainable_state_dict({k[len(OLD):]: v for k, v in state.items() if k.startswith(OLD)})

    def step_done(self) -> None:
        """Count the optimiser step: g += 1 at `after_update` (their global_step += 1 per optimizer.step)."""
        self.steps_this_update += 1

    def optimiser_steps(self) -> int:
        """g after this update: the steps before it plus this update's. A checkpoint from before the count was kept
        (no `optimiser_steps` in its state) is taken to have run this update's number of steps per update."""
        before = self.state.get(STEPS)
        done = self.schedule.index * self.steps_this_update if before is None else int(before)
        return done + self.steps_this_update

    @torch.no_grad()
    def after_update(self, hooks: LearnerHooks, metrics: dict[str, float]) -> dict[str, float]:
        """old <- d old + (1 - d) theta, d = d(g) with g the optimiser steps done, this update's included (their
        `return_decay(global_step)` after the epoch's last optimizer.step; module docstring)."""
        g = self.optimiser_steps()
        self.state[STEPS], self.steps_this_update = torch.tensor(g), 0
        d = old_decay(self.cfg, g)
        if self.old is not None:
            current = hooks.weights()
            for k, v in self.old.state.items():
                if v.is_floating_point():
                    v.mul_(d).add_(current[k].to(device=v.device, dtype=v.dtype), alpha=1 - d)
        return {"nft/old_decay": d, "nft/optimiser_steps": float(g)}

    def branches(self, inputs: TermInputs) -> tuple[Tensor, Tensor]:
        """(v+, v-): v+ = beta v_theta + (1 - beta) v_old, v- = (1 + beta) v_old - beta v_theta."""
        beta, v, v_old = self.cfg.beta, inputs.velocity, inputs.old_velocity.detach()
        return beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v

    def loss(self, inputs: TermInputs, stats: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
        """sum over the piece of (policy term + kl_coef mean (v_theta - v_ref)^2) / n_terms."""
        r = optimality(inputs.advantages.to(inputs.velocity.dtype), self.cfg.adv_clip)
        policy, metrics = self.policy_terms(inputs, r)  # [b]
        total = policy
        if self.cfg.kl_coef > 0:
            kl = per_sample_mean((inputs.velocity - inputs.ref_velocity.detach()) ** 2)  # mean (v_theta - v_ref)^2
            total = total + self.kl_weight * kl
            metrics["nft/kl"] = kl.detach().mean()
        metrics["nft/policy_loss"] = policy.detach().mean()
        metrics["nft/old_deviate"] = per_sample_mean((inputs.velocity - inputs.old_velocity) ** 2).detach().mean()
        return total.sum() / inputs.n_terms, metrics

    @abstractmethod
    def policy_terms(self, inputs: TermInputs, r: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """Each sample's policy loss [b] (with grad): each form defines its own."""


@register("diffusion_nft.code")
class DiffusionNFTCode(DiffusionNFT):
    """The authors' code: self-normalised x0-space branches, batch-wide advantage std (module docstring)."""

    Settings = DiffusionNFTCodeSettings
    batch_std = True

    def policy_terms(self, inputs: TermInputs, r: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """c (r L+ + (1 - r) L-) / beta, L± = mean (x0hat± - x0)^2 / w± (module docstring)."""
        t = inputs.t.view(-1, *([1] * (inputs.x0.dim() - 1)))
        losses = []
        for v_branch in self.branches(inputs):
            x0_hat = inputs.x_t - t * v_branch  # x0hat = x_t - t v
            err = x0_hat - inputs.x0
            w = per_sample_mean(err.detach().double().abs()).clamp(min=1e-5)  # w = sg(max(mean |x0hat - x0|, 1e-5))
            losses.append(per_sample_mean(err**2) / w.to(err.dtype))  # L = mean (x0hat - x0)^2 / w
        positive, negative = losses
        c, beta = self.cfg.adv_clip, self.cfg.beta
        return c * (r * positive + (1 - r) * negative) / beta, {"nft/positive_loss": positive.detach().mean()}


@register("diffusion_nft.paper")
class DiffusionNFTPaper(DiffusionNFT):
    """The paper's equation: velocity MSE of both branches to the flow-matching target, per-prompt std."""

    Settings = DiffusionNFTPaperSettings
    batch_std = False

    def policy_terms(self, inputs: TermInputs, r: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """r mean (v+ - v)^2 + (1 - r) mean (v- - v)^2, v = eps - x0 = (x_t - x0) / t."""
        t = inputs.t.view(-1, *([1] * (inputs.x0.dim() - 1)))
        target = (inputs.x_t - inputs.x0) / t  # v = eps - x0 (t > 0 on the sampler's grid values)
        positive, negative = (per_sample_mean((v_branch - target) ** 2) for v_branch in self.branches(inputs))
        return r * positive + (1 - r) * negative, {"nft/positive_loss": positive.detach().mean()}
