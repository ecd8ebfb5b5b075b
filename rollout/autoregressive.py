"""Autoregressive sampling of a causal LM behind the sampler seam, with two generation backends.

A completion y of prompt x is drawn token by token from the behaviour policy softmax(logits / T) and stops at
its first EOS (positions after it hold the pad id). Its likelihood is exact, no Monte-Carlo estimate:

    log pi(y | x) = sum_{t in V} log softmax(f(x, y_<t) / T)[y_t],   V = positions up to and including the EOS

(`logp_reduce: mean` divides by |V|). For training the sampler is sequence-level with one "step" (that exact
likelihood), so every objective of the masked-diffusion LMs applies: sequence ratios (grpo, stabledrl, bgpo)
and per-token ratios (`token_level` objectives such as grpo.d1, from `SequenceLogProb.token_logp`).

Who generates is a `GenerationBackend`:
  transformers  `TransformersGeneration`: a KV-cached loop over the policy in this process, draws from the
                step's CPU generator (a seed replays the same tokens);
  vllm          `rollout.vllm_engine.VLLMEngine`: an engine inside the rollout worker, which the worker holds as
                its policy (the learner's weights are pushed into it after every update).
Each returns the completion and its per-token behaviour log-probs. The batch keeps them (`old_logp`, reduced,
and extras `behaviour_token_logp`); the learner recomputes its own (`log_prob`, one full forward pass) and logs the
gap (`policy/rollout_logp_absdiff_max`). An engine's samples carry `behaviour_engine`, and the learner weighs
them by min(pi_prox / pi_b, cap) as it weighs lagged samples (trainer/off_policy.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from steadyrl.rollout.batch import BEHAVIOUR_ENGINE, BEHAVIOUR_TOKEN_LOGP, RolloutBatch
from steadyrl.rollout.config import AutoregressiveSamplerConfig
from steadyrl.rollout.likelihood import (SequenceLogProb, completion_valid, entropy_of, k3_kl, mean_over,
                                         prompt_attention)
from steadyrl.rollout.masked_diffusion import gumbel_argmax
from steadyrl.rollout.policy import module_device
from steadyrl.rollout.sampler import LogProb


@dataclass
class Generated:
    """Completions [B, L] (pad after each row's first EOS) and their per-token behaviour log-probs [B, L] (0 there)."""

    tokens: Tensor
    token_logp: Tensor


@runtime_checkable
class GenerationBackend(Protocol):
    """Who draws completions: `generate_tokens(prompts [B, P] left-padded, attention [B, P] or None, max_tokens,
    temperature, eos_id, pad_id, generator) -> Generated`, everything on the CPU."""

    #: the backend's log-probs come from numerics other than the learner's (an inference engine)
    engine: bool

    def generate_tokens(self, prompts: Tensor, attention: Tensor | None, max_tokens: int, temperature: float,
                        eos_id: int, pad_id: int, generator: torch.Generator) -> Generated: ...


def scaled_log_softmax(logits: Tensor, temperature: float) -> Tensor:
    """log softmax(logits / T) in at least float32 (T = 0, greedy: T taken as 1 for scoring)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)


def positions(attention: Tensor) -> Tensor:
    """Position ids counted from each row's first real token (left padding)."""
    return (attention.long().cumsum(dim=1) - 1).clamp(min=0)


class TransformersGeneration:
    """The `transformers` backend: a KV-cached sampling loop over a causal LM (any module called as
    `model(ids, attention_mask=, position_ids=, past_key_values=, use_cache=)`) on its own device."""

    engine = False

    def __init__(self, model):
        self.model = model

    @torch.no_grad()
    def generate_tokens(self, prompts: Tensor, attention: Tensor | None, max_tokens: int, temperature: float,
                        eos_id: int, pad_id: int, generator: torch.Generator) -> Generated:
        device = module_device(self.model)
        B = len(prompts)
        att = (torch.ones_like(prompts, dtype=torch.long) if attention is None else attention.long()).to(device)
        out = self.model(prompts.to(device), attention_mask=att, position_ids=positions(att), use_cache=True)
        next_pos = positions(att)[:, -1] + 1
        tokens = torch.full((B, max_tokens), pad_id, dtype=torch.long)
        logps = torch.zeros(B, max_tokens, dtype=torch.promote_types(out.logits.dtype, torch.float32))
        done = torch.zeros(B, dtype=torch.bool)
        for t in range(max_tokens):
            logits = out.logits[:, -1]
            tok = gumbel_argmax(logits.float(), temperature, generator).cpu()
            lp = scaled_log_softmax(logits, temperature).gather(-1, tok.to(device).unsqueeze(-1)).squeeze(-1).cpu()
            tokens[:, t] = torch.where(done, pad_id, tok)
            logps[:, t] = torch.where(done, 0.0, lp)
            done |= tok == eos_id
            if bool(done.all()) or t == max_tokens - 1:
                break
            att = torch.cat([att, att.new_ones(B, 1)], dim=1)
            out = self.model(tokens[:, t:t + 1].to(device), attention_mask=att, position_ids=next_pos.unsqueeze(1),
                             use_cache=True, **kv_cache(out))
            next_pos = next_pos + 1
        return Generated(tokens, logps)


def kv_cache(out) -> dict:
    """The forward's key/value cache as the keyword the next call takes (transformers >= 5.2x names it `cache`,
    earlier releases `past_key_values`)."""
    cache = getattr(out, "cache", None)
    return {"cache": cache} if cache is not None else {"past_key_values": out.past_key_values}


def generation_backend(policy) -> GenerationBackend:
    """The policy itself when it is a backend (an inference engine), else the transformers loop over it."""
    return policy if isinstance(policy, GenerationBackend) else TransformersGeneration(policy)


class AutoregressiveSampler:
    """Sampling and the exact likelihood of a causal LM (see the module docstring)."""

    sequence_level = True
    independent_masks = False  # nothing is Monte-Carlo: old, new and reference score the same exact likelihood

    def __init__(self, cfg: AutoregressiveSamplerConfig, eos_token_id: int, pad_token_id: int):
        self.cfg = cfg
        self.eos_token_id, self.pad_token_id = int(eos_token_id), int(pad_token_id)
        self.timesteps = torch.zeros(1, dtype=torch.long)
        self.trainable = torch.ones(1, dtype=torch.bool)

    @property
    def reduce(self) -> str:
        return self.cfg.logp_reduce

    def train_steps(self, min_std: float = 0.0) -> Tensor:
        """The one exact likelihood."""
        return torch.zeros(1, dtype=torch.long)

    def with_fresh_masks(self, batch: RolloutBatch, generator: torch.Generator) -> RolloutBatch:
        """Unchanged: there are no Monte-Carlo masks to redraw."""
        return batch

    def attention(self, prompts: Tensor) -> Tensor | None:
        """The prompts' padding mask [B, P] (True = real token), None when no row is padded."""
        return prompt_attention(prompts, self.pad_token_id)

    def valid(self, completion: Tensor) -> Tensor:
        """V [B, L]: completion positions up to and including the first EOS."""
        return completion_valid(completion, self.eos_token_id)

    def reduced(self, token_logp: Tensor, valid: Tensor) -> Tensor:
        """sum_{t in V} token_logp [B] (`mean`: divided by |V|)."""
        total = (token_logp * valid).sum(dim=-1)
        return total / valid.sum(dim=-1).clamp(min=1) if self.reduce == "mean" else total

    @torch.no_grad()
    def sample(self, policy, cond: Tensor, n_per_cond: int, generator: torch.Generator, group_offset: int = 0,
               **_: object) -> RolloutBatch:
        """`n_per_cond` completions per prompt (cond: prompt ids [C, P], left-padded), one group each, with the
        backend's per-token log-probs; the batch is on the CPU."""
        prompts = cond.long().cpu().repeat_interleave(n_per_cond, dim=0)
        group = (group_offset + torch.arange(len(cond))).repeat_interleave(n_per_cond)
        backend = generation_backend(policy)
        out = backend.generate_tokens(prompts, self.attention(prompts), self.cfg.gen_length, self.cfg.temperature,
                                      self.eos_token_id, self.pad_token_id, generator)
        valid = self.valid(out.tokens)
        token_logp = out.token_logp * valid
        return RolloutBatch(cond=prompts, group=group, samples=out.tokens, traj=out.tokens.unsqueeze(1),
                            old_logp=self.reduced(token_logp, valid).unsqueeze(1), timesteps=self.timesteps.clone(),
                            trainable=self.trainable.clone(),
                            extras={BEHAVIOUR_TOKEN_LOGP: token_logp,
                                    BEHAVIOUR_ENGINE: torch.full((len(prompts),), bool(backend.engine))})

    def log_prob(self, policy, batch: RolloutBatch, step: Tensor | int = 0, entropy: bool = False) -> SequenceLogProb:
        """The exact log-likelihood [B] of the stored completions under `policy` (one forward pass over
        [prompt | completion]), with its per-token terms; `step` is always the one likelihood. With `entropy`, each
        row's mean entropy of softmax(logits / T) over V (the scored positions), from the same pass."""
        prompts, completion = batch.cond, batch.samples
        P = prompts.shape[1]
        attention = self.attention(prompts)
        att = torch.ones(len(batch), P + completion.shape[1], dtype=torch.long, device=completion.device)
        if attention is not None:
            att[:, :P] = attention.long()
        logits = policy(torch.cat([prompts, completion], dim=1), attention_mask=att, position_ids=positions(att)).logits
        logp = scaled_log_softmax(logits[:, P - 1:-1], self.cfg.temperature)
        token_logp = logp.gather(-1, completion.unsqueeze(-1)).squeeze(-1)
        valid = self.valid(completion)
        token_logp = token_logp * valid
        ent = mean_over(entropy_of(logp), valid) if entropy else None
        return SequenceLogProb(self.reduced(token_logp, valid), token_logp, valid, valid, ent)

    def kl(self, new: LogProb, ref: LogProb) -> Tensor:
        """k3 estimate of KL(pi_theta || pi_ref) per sample (`likelihood.k3_kl`)."""
        return k3_kl(new, ref)
