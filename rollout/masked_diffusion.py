"""LLaDA-style masked-diffusion sampling, behind the same sampler seam as the image samplers.

Generation (one batch, fixed length L, `num_steps` steps, blocks of `block_length`):

    x = [prompt | <mask> * L]
    for each block b (left to right: semi-autoregressive), for each of its num_steps / num_blocks steps:
        logits = model(x)                                   with CFG: u + (w + 1) (c - u), u = prompt masked
                                                            (`likelihood.guided_logits`, as the estimators)
        y_hat  = argmax(logits / T + G),  G ~ Gumbel(0, 1)  in float64 (T = 0: argmax, deterministic)
        conf   = softmax(logits)[y_hat] (low_confidence) or U(0, 1) (random); -inf outside block b and
                 at positions already decoded
        commit the k highest-confidence positions of the row, k from the block's transfer schedule
               (m masked tokens over s steps: m // s each, the first m % s steps one more)

Prompts of different lengths are left-padded (pad id) and the model attends only to their real tokens
(`likelihood.model_logits`; `attend_pads`: to the pads as well, as d1's code); positions after a completion's
first EOS are left out of every likelihood term unless `score_after_eos` (`likelihood`, "Padding and EOS").

Greedy decoding (T = 0, low_confidence) is deterministic: the same prompt gives the same completion.
`argmax(logits / T + G)` is LLaDA's `argmax(exp(logits) / (-log U)^T)` written without overflow.

For training a "step" of this sampler is a Monte-Carlo mask sample j = 0..n-1 of the likelihood
estimator (`rollout.likelihood`): the sequence log-likelihood of a sample is the mean over its n
steps, which the learner uses as one sequence-level ratio (`sequence_level = True`). The sampler is a
`rollout.sampler.SequenceSampler`: `log_prob` returns a `SequenceLogProb` (the estimate and its per-token
terms); there is no Gaussian std, mean or step length.
"""
from __future__ import annotations

import torch
from torch import Tensor

from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import MaskedDiffusionSamplerConfig
from steadyrl.rollout.likelihood import (
    MaskDraw,
    SequenceLogProb,
    completion_valid,
    draw_masks,
    estimate,
    guided_logits,
    k3_kl,
    prompt_attention,
)
from steadyrl.rollout.policy import module_device
from steadyrl.rollout.sampler import LogProb


def transfer_schedule(masked: int, steps: int) -> list[int]:
    """Tokens committed at each of `steps` steps for `masked` masked positions (LLaDA's schedule)."""
    base, extra = divmod(masked, steps)
    return [base + (1 if i < extra else 0) for i in range(steps)]


def gumbel_argmax(logits: Tensor, temperature: float, generator: torch.Generator | None) -> Tensor:
    """argmax(logits / T + Gumbel noise) (a sample of softmax(logits / T)); T = 0: plain argmax."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    u = torch.rand(logits.shape, generator=generator, dtype=torch.float64).clamp_(min=1e-20).to(logits.device)
    return (logits.double() / temperature - torch.log(-torch.log(u))).argmax(dim=-1)


class MaskedDiffusionSampler:
    """Masked-diffusion generation and the likelihood estimators' per-MC-sample log-probs."""

    sequence_level = True

    def __init__(self, cfg: MaskedDiffusionSamplerConfig, mask_token_id: int, eos_token_id: int | None = None,
                 pad_token_id: int | None = None):
        """`eos_token_id`: ends a completion (needed unless `cfg.score_after_eos`); `pad_token_id`: left-pads
        prompts (None: prompts are never padded)."""
        if eos_token_id is None and not cfg.score_after_eos:
            raise ValueError("the masked-diffusion sampler needs the tokenizer's EOS token id to leave positions after "
                             "it out of the likelihood (sampler.score_after_eos=false); the tokenizer declares none: "
                             "name one (testbed.eos_token_id) or set sampler.score_after_eos=true")
        ids = {"mask": mask_token_id, "eos": eos_token_id, "pad": pad_token_id}
        if mask_token_id in (eos_token_id, pad_token_id):
            raise ValueError(f"the mask token id must differ from the EOS and pad ids, got {ids}")
        self.cfg = cfg
        self.mask_token_id = int(mask_token_id)
        self.eos_token_id = None if eos_token_id is None else int(eos_token_id)
        self.pad_token_id = None if pad_token_id is None else int(pad_token_id)
        n = cfg.mc_samples
        self.timesteps = torch.arange(n)
        self.trainable = torch.ones(n, dtype=torch.bool)

    @property
    def reduce(self) -> str:
        return self.cfg.logp_reduce

    def train_steps(self, min_std: float = 0.0) -> Tensor:
        """Every MC sample (there is no std to threshold)."""
        return torch.arange(self.cfg.mc_samples)

    # ------------------------------------------------------------------ layout
    def attention(self, prompts: Tensor) -> Tensor | None:
        """The prompts' padding mask [B, P] (True = real token), None when no row is padded or under
        `attend_pads` (d1's code: the model is called without a mask, pads attended), in generation and every
        likelihood pass."""
        return None if self.cfg.attend_pads else prompt_attention(prompts, self.pad_token_id)

    def valid(self, completion: Tensor) -> Tensor | None:
        """V [B, L]: completion positions up to the first EOS; None under `score_after_eos` (all scored)."""
        return None if self.cfg.score_after_eos else completion_valid(completion, self.eos_token_id)

    # ------------------------------------------------------------------ generation
    def _logits(self, policy, x: Tensor, prompt_length: int, attention: Tensor | None) -> Tensor:
        """Next-guess logits ([B, S, V], guided as the estimators are); the mask token itself is never a guess."""
        logits = guided_logits(policy, x, prompt_length, self.mask_token_id, self.cfg.cfg_scale, attention).clone()
        logits[..., self.mask_token_id] = -torch.inf
        return logits

    @torch.no_grad()
    def generate(self, policy, prompts: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Completions [B, L] for prompts [B, P] (see the module docstring), on the policy's device; random
        draws come from the CPU `generator` and move there, so a seed gives the same tokens on any device up to
        the network's numerics."""
        cfg = self.cfg
        L, block = cfg.gen_length, cfg.block_length or cfg.gen_length
        n_blocks = L // block
        per_block = cfg.num_steps // n_blocks
        P = prompts.shape[1]
        device = module_device(policy)
        prompts = prompts.to(device)
        attention = self.attention(prompts)
        x = torch.cat([prompts, torch.full((len(prompts), L), self.mask_token_id, dtype=torch.long, device=device)],
                      dim=1)
        rows = torch.arange(len(prompts), device=device)
        for b in range(n_blocks):
            end = P + (b + 1) * block
            for k in transfer_schedule(block, per_block):
                if k == 0:
                    continue
                masked = x == self.mask_token_id
                logits = self._logits(policy, x, P, attention)
                guess = gumbel_argmax(logits, cfg.temperature, generator)
                if cfg.remasking == "low_confidence":
                    conf = torch.softmax(logits.double(), dim=-1).gather(-1, guess.unsqueeze(-1)).squeeze(-1)
                else:
                    conf = torch.rand(x.shape, generator=generator, dtype=torch.float64).to(device)
                conf[:, end:] = -torch.inf
                conf = torch.where(masked, conf, -torch.inf)
                pick = conf.topk(k, dim=-1).indices
                x[rows.unsqueeze(1), pick] = guess[rows.unsqueeze(1), pick]
        return x[:, P:]

    @torch.no_grad()
    def sample(self, policy, cond: Tensor, n_per_cond: int, generator: torch.Generator,
               group_offset: int = 0, **_: object) -> RolloutBatch:
        """`n_per_cond` completions per prompt (cond: prompt ids [C, P]); one group per prompt. Stores the
        MC masks (extras `mc_masks` [B, n, L], `prompt_masks` [B, n, P]) and their estimates as old_logp [B, n].
        The batch comes back on the CPU, ready for the object store."""
        prompts = cond.long().cpu().repeat_interleave(n_per_cond, dim=0)
        group = (group_offset + torch.arange(len(cond))).repeat_interleave(n_per_cond)
        completion = self.generate(policy, prompts, generator).cpu()
        masks = self.draw_masks(len(prompts), prompts.shape[1], generator, self.valid(completion))
        batch = RolloutBatch(cond=prompts, group=group, samples=completion, traj=completion.unsqueeze(1),
                             old_logp=torch.zeros(len(prompts), self.cfg.mc_samples),
                             timesteps=self.timesteps.clone(), trainable=self.trainable.clone(),
                             extras={"mc_masks": masks.completion, "prompt_masks": masks.prompt})
        on_device = batch.to(device=module_device(policy))
        logp = torch.stack([self.log_prob(policy, on_device, j).logp
                            for j in range(self.cfg.mc_samples)], dim=1)
        return batch.replace(old_logp=logp.cpu())

    # ------------------------------------------------------------------ likelihood
    @property
    def independent_masks(self) -> bool:
        """`masks: independent`: the learner evaluates the new policy on masks of its own (`with_fresh_masks`)."""
        return self.cfg.masks == "independent"

    def with_fresh_masks(self, batch: RolloutBatch, generator: torch.Generator) -> RolloutBatch:
        """The batch with newly drawn MC masks (independent of the rollout's, which the old policy keeps)."""
        valid = self.valid(batch.samples)  # masks are drawn on the CPU (the generator's), then join the batch
        masks = self.draw_masks(len(batch), batch.cond.shape[1], generator, None if valid is None else valid.cpu())
        device = batch.samples.device
        return batch.with_extras(mc_masks=masks.completion.to(device), prompt_masks=masks.prompt.to(device))

    def draw_masks(self, batch_size: int, prompt_length: int, generator: torch.Generator,
                   valid: Tensor | None = None) -> MaskDraw:
        """The MC masks of `batch_size` sequences under this sampler's estimator and mask scheme (among the
        `valid` positions: up to each completion's first EOS)."""
        c = self.cfg
        return draw_masks(c.estimator, batch_size, c.mc_samples, c.gen_length, prompt_length, c.prompt_mask_prob,
                          generator, c.mask_scheme, c.block_length, valid, c.stratified_batch_size)

    def log_prob(self, policy, batch: RolloutBatch, step: Tensor | int, entropy: bool = False) -> SequenceLogProb:
        """The estimator at MC sample(s) `step` (int or [B]) of each row, with the batch's stored masks:
        logp [B] and the per-token terms it was built from; with `entropy`, each row's mean token entropy over the
        scored positions (`likelihood.estimate`)."""
        device = batch.samples.device
        if isinstance(step, int):
            step = torch.full((len(batch),), step, dtype=torch.long)
        rows, step = torch.arange(len(batch), device=device), step.to(device)
        masks = (batch.extras["mc_masks"][rows, step], batch.extras["prompt_masks"][rows, step])
        return estimate(policy, self.cfg.estimator, batch.cond, batch.samples, masks, self.mask_token_id, self.reduce,
                        self.cfg.cfg_scale, self.attention(batch.cond), self.valid(batch.samples), entropy)

    def kl(self, new: LogProb, ref: LogProb) -> Tensor:
        """k3 estimate of KL(pi_theta || pi_ref) per sample (`likelihood.k3_kl`)."""
        return k3_kl(new, ref)
