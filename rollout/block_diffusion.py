"""Uniform-noise block diffusion (DiffusionGemma) behind the sampler seam, with two generation backends.

Generation (DiffusionGemma's entropy-bound sampler, as transformers' `generate` and vLLM's `DiffusionSampler` run it;
N = `num_steps`, blocks of CL = `canvas_length` tokens, left to right):

    for each block: canvas c ~ U(vocab)^CL, self-conditioning s = none
        for step k = 0..N-1:
            T_k   = t_min + (t_max - t_min) (N - k) / N                       (linear, t_max first)
            l     = f(c | prefix, s) / T_k                                     (bidirectional over the canvas)
            y~    ~ softmax(l) per position,  a = argmax l,  H = entropy(softmax(l))
            accept the lowest-entropy positions while  sum(H_acc) - max(H_acc) <= entropy_bound
            c     = y~ at accepted positions, fresh uniform ids elsewhere;  s = l
            stop once a is unchanged for `stability_threshold` steps and mean(H) < confidence_threshold
        commit a (the argmax canvas) to the prefix

The committed tokens are argmaxes: the behaviour policy has no tractable likelihood, and what an engine returns per
token, log softmax(l)[a] at the converging step (extras `commit_logp`), is a confidence, not a log-probability of
the sample. The learner computes every likelihood itself, with an estimator made for uniform noise (there is no
mask token). One Monte-Carlo "step" j draws, in each block b with V_b its positions up to the first EOS (L_b of them),

    l_b ~ U{1..L_b},  M_b = l_b positions of V_b,  z ~ U(vocab)^L                (extras `mc_masks`, `mc_noise`)
    canvas_b = z at M_b and after the EOS, y elsewhere in the block
    ell_j   = sum_b (L_b / l_b) sum_{i in M_b} log p(y_i | canvas_b, s_b, x, y_<b)  (`reduce: mean` divides by L_V)
    s_b     = the model's own no-grad logits at canvas_b (`self_conditioning`, as the sampler conditions every step
              after its first; off: none, one pass)

the masked-diffusion ELBO's weighting with uniform corruption in place of the mask (each block scored against its
clean prefix, as block diffusion factorises log pi(y|x) = sum_b log pi(y_b | x, y_<b)). It is a surrogate, not an
exact bound of uniform-noise diffusion; old, new and reference policy score the same draws, so the ratio is exactly
1 on policy. The sequence log-likelihood is the mean over the n draws (`sequence_level`, as masked diffusion).

Who generates is a `BlockGenerationBackend`:
  transformers  `TransformersBlockGeneration`: the loop above over the policy in this process, every random draw from
                the step's CPU generator (a seed replays the same tokens);
  vllm          `rollout.vllm_diffusion.VLLMBlockDiffusionEngine`: vLLM's DiffusionGemma engine in the rollout worker
                (GPU only in vLLM 0.32). Its samples carry no old log-probability (NaN): the learner's recompute is
                the old policy.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from steadyrl.rollout.autoregressive import Generated
from steadyrl.rollout.batch import COMMIT_LOGP, RolloutBatch
from steadyrl.rollout.block_diffusion_lm import block_logits
from steadyrl.rollout.config import BlockDiffusionSamplerConfig
from steadyrl.rollout.likelihood import (SequenceLogProb, completion_valid, draw_masks, entropy_of, k3_kl,
                                         masked_estimate, mean_over, prompt_attention)
from steadyrl.rollout.masked_diffusion import gumbel_argmax
from steadyrl.rollout.policy import module_device
from steadyrl.rollout.sampler import LogProb


@runtime_checkable
class BlockGenerationBackend(Protocol):
    """Who draws completions: `generate_blocks(prompts [B, P] left-padded, attention [B, P] or None, cfg, eos_id,
    pad_id, generator) -> Generated` (tokens [B, L], pad after the first EOS; `token_logp`: the commit confidences),
    everything on the CPU."""

    #: an inference engine: no likelihood of its own samples, the learner recomputes every one
    engine: bool

    def generate_blocks(self, prompts: Tensor, attention: Tensor | None, cfg: BlockDiffusionSamplerConfig,
                        eos_id: int, pad_id: int, generator: torch.Generator) -> Generated: ...


def temperature(cfg: BlockDiffusionSamplerConfig, step: int) -> float:
    """T_k = t_min + (t_max - t_min) (N - k) / N: t_max at the first step, t_min + (t_max - t_min) / N at the last."""
    N = cfg.num_steps
    return cfg.t_min + (cfg.t_max - cfg.t_min) * (N - step) / N


def entropy(logits: Tensor) -> Tensor:
    """H(softmax(logits)) per position, in float64."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def entropy_bound_accept(H: Tensor, bound: float) -> Tensor:
    """[B, CL] the lowest-entropy positions with sum(H) - max(H) <= bound (H sorted ascending: max = the last one)."""
    sorted_h, order = H.sort(dim=-1)
    keep = sorted_h.cumsum(dim=-1) - sorted_h <= bound
    return torch.zeros_like(keep).scatter(-1, order, keep)


def uniform_ids(shape: tuple[int, ...], vocab: int, generator: torch.Generator | None, device) -> Tensor:
    """Uniform token ids, drawn on the CPU (the generator's) and moved to `device`."""
    return torch.randint(vocab, shape, generator=generator).to(device)


def after_first_eos(tokens: Tensor, eos_id: int, pad_id: int) -> Tensor:
    """`tokens` with every position after the first EOS set to the pad id (what an engine returns)."""
    return tokens.masked_fill(~completion_valid(tokens, eos_id), pad_id)


class TransformersBlockGeneration:
    """The `transformers` backend: the loop in the module docstring over a DiffusionGemma on its own device."""

    engine = False

    def __init__(self, model, vocab_size: int):
        """`vocab_size`: the model's, which its noise ids are drawn from."""
        self.model, self.vocab_size = model, int(vocab_size)

    @torch.no_grad()
    def denoise_block(self, prefix: Tensor, attention: Tensor, cfg: BlockDiffusionSamplerConfig,
                      generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """One block: the committed argmax canvas [B, CL] and log softmax(l)[a] at each row's last step."""
        B, CL, V, device = len(prefix), cfg.block, self.vocab_size, prefix.device
        canvas = uniform_ids((B, CL), V, generator, device)
        history = torch.full((cfg.stability_threshold, B, CL), -1, dtype=torch.long, device=device)
        done = torch.zeros(B, dtype=torch.bool, device=device)
        argmax, conditioning, confidence = canvas, None, torch.zeros(B, CL, device=device)
        for k in range(cfg.num_steps):
            logits = block_logits(self.model, prefix, attention, canvas, conditioning) / temperature(cfg, k)
            H = entropy(logits)
            accept = entropy_bound_accept(H, cfg.entropy_bound)
            drawn = gumbel_argmax(logits, 1.0, generator)
            noise = uniform_ids((B, CL), V, generator, device)
            new_canvas = torch.where(accept, drawn, noise)
            new_argmax = logits.argmax(dim=-1)
            held = done.unsqueeze(1)  # rows already converged keep their state (as transformers' generate)
            canvas, argmax = torch.where(held, canvas, new_canvas), torch.where(held, argmax, new_argmax)
            step_conf = torch.log_softmax(logits, dim=-1).gather(-1, new_argmax.unsqueeze(-1)).squeeze(-1)
            confidence = torch.where(held, confidence, step_conf)
            stable = (history == argmax).all(dim=-1).all(dim=0)
            if cfg.stability_threshold:
                history = torch.cat([history[1:], argmax.unsqueeze(0)])
            # a converged row stays done, and what it is fed or computes next is never used
            done |= stable & (H.mean(dim=-1) < cfg.confidence_threshold)
            conditioning = logits
            if bool(done.all()):
                break
        return argmax, confidence

    def generate_blocks(self, prompts: Tensor, attention: Tensor | None, cfg: BlockDiffusionSamplerConfig,
                        eos_id: int, pad_id: int, generator: torch.Generator) -> Generated:
        device = module_device(self.model)
        prefix = prompts.to(device)
        att = torch.ones_like(prefix, dtype=torch.bool) if attention is None else attention.to(device)
        blocks, confidences = [], []
        for _ in range(cfg.gen_length // cfg.block):
            block, conf = self.denoise_block(prefix, att, cfg, generator)
            blocks.append(block)
            confidences.append(conf)
            prefix = torch.cat([prefix, block], dim=1)
            att = torch.cat([att, torch.ones_like(block, dtype=torch.bool)], dim=1)
        tokens = after_first_eos(torch.cat(blocks, dim=1).cpu(), eos_id, pad_id)
        return Generated(tokens, torch.cat(confidences, dim=1).float().cpu() * completion_valid(tokens, eos_id))


def block_backend(policy, vocab_size: int) -> BlockGenerationBackend:
    """The policy itself when it is a backend (an inference engine), else the transformers loop over it."""
    return policy if isinstance(policy, BlockGenerationBackend) else TransformersBlockGeneration(policy, vocab_size)


class BlockDiffusionSampler:
    """Block-diffusion generation and the uniform-noise likelihood estimator (see the module docstring)."""

    sequence_level = True

    def __init__(self, cfg: BlockDiffusionSamplerConfig, vocab_size: int, eos_token_id: int, pad_token_id: int):
        """`vocab_size`: the model's (noise ids are drawn from all of it, as its sampler draws them)."""
        self.cfg = cfg
        self.vocab_size = int(vocab_size)
        self.eos_token_id, self.pad_token_id = int(eos_token_id), int(pad_token_id)
        self.timesteps = torch.arange(cfg.mc_samples)
        self.trainable = torch.ones(cfg.mc_samples, dtype=torch.bool)

    @property
    def reduce(self) -> str:
        return self.cfg.logp_reduce

    @property
    def independent_masks(self) -> bool:
        return self.cfg.masks == "independent"

    def train_steps(self, min_std: float = 0.0) -> Tensor:
        """Every Monte-Carlo draw (there is no std to threshold)."""
        return torch.arange(self.cfg.mc_samples)

    def attention(self, prompts: Tensor) -> Tensor | None:
        """The prompts' padding mask [B, P] (True = real token), None when no row is padded."""
        return prompt_attention(prompts, self.pad_token_id)

    def valid(self, completion: Tensor) -> Tensor:
        """V [B, L]: completion positions up to and including the first EOS."""
        return completion_valid(completion, self.eos_token_id)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def sample(self, policy, cond: Tensor, n_per_cond: int, generator: torch.Generator,
               group_offset: int = 0, **_: object) -> RolloutBatch:
        """`n_per_cond` completions per prompt (cond: prompt ids [C, P], left-padded), one group each, with the
        noise draws of the estimator (extras `mc_masks`, `mc_noise` [B, n, L]) and the commit confidences
        (`commit_logp` [B, L]). old_logp [B, n] is the estimator under the sampling policy, or NaN from an engine
        (the learner's recompute is then the old policy). The batch is on the CPU."""
        prompts = cond.long().cpu().repeat_interleave(n_per_cond, dim=0)
        group = (group_offset + torch.arange(len(cond))).repeat_interleave(n_per_cond)
        backend = block_backend(policy, self.vocab_size)
        out = backend.generate_blocks(prompts, self.attention(prompts), self.cfg, self.eos_token_id,
                                      self.pad_token_id, generator)
        masks, noise = self.draw_noise(out.tokens, generator)
        n = self.cfg.mc_samples
        batch = RolloutBatch(cond=prompts, group=group, samples=out.tokens, traj=out.tokens.unsqueeze(1),
                             old_logp=torch.full((len(prompts), n), torch.nan), timesteps=self.timesteps.clone(),
                             trainable=self.trainable.clone(),
                             extras={"mc_masks": masks, "mc_noise": noise, COMMIT_LOGP: out.token_logp})
        if backend.engine:
            return batch
        on_device = batch.to(device=module_device(policy))
        logp = torch.stack([self.log_prob(policy, on_device, j).logp for j in range(n)], dim=1)
        return batch.replace(old_logp=logp.cpu())

    # ------------------------------------------------------------------ likelihood
    def draw_noise(self, completion: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """The n draws of every row: corrupted positions M [B, n, L] (l_b ~ U{1..L_b} of each block's positions up
        to the first EOS) and the uniform ids z [B, n, L] they take, on the CPU."""
        B, L = completion.shape
        n, CL = self.cfg.mc_samples, self.cfg.block
        valid = self.valid(completion.cpu())
        masks = torch.cat([draw_masks("elbo", B, n, CL, 0, 0.0, generator, "uniform", None,
                                      valid[:, s:s + CL]).completion for s in range(0, L, CL)], dim=-1)
        return masks & valid.unsqueeze(1), torch.randint(self.vocab_size, (B, n, L), generator=generator)

    def with_fresh_masks(self, batch: RolloutBatch, generator: torch.Generator) -> RolloutBatch:
        """The batch with newly drawn noise (independent of the rollout's, which the old policy keeps)."""
        masks, noise = self.draw_noise(batch.samples, generator)
        device = batch.samples.device
        return batch.with_extras(mc_masks=masks.to(device), mc_noise=noise.to(device))

    def log_prob(self, policy, batch: RolloutBatch, step: Tensor | int, entropy: bool = False) -> SequenceLogProb:
        """The estimator at draw(s) `step` (int or [B]) of each row: logp [B] and its per-token terms; with
        `entropy`, each row's mean token entropy over its scored (masked, valid) positions, from the same passes."""
        prompts, y = batch.cond, batch.samples
        device, (B, L), CL = y.device, y.shape, self.cfg.block
        if isinstance(step, int):
            step = torch.full((B,), step, dtype=torch.long)
        rows, step = torch.arange(B, device=device), step.to(device)
        masks, noise = batch.extras["mc_masks"][rows, step], batch.extras["mc_noise"][rows, step]
        valid = self.valid(y)
        masks = masks & valid
        prompt_att = self.attention(prompts)
        prompt_att = torch.ones_like(prompts, dtype=torch.bool) if prompt_att is None else prompt_att
        token_logp = torch.zeros(B, L, device=device)
        token_ent = torch.zeros(B, L, device=device) if entropy else None
        value = torch.zeros(B, device=device)
        for s in range(0, L, CL):
            m, v = masks[:, s:s + CL], valid[:, s:s + CL]
            if not bool(v.any()):
                break  # every row ended before this block
            canvas = torch.where(m | ~v, noise[:, s:s + CL], y[:, s:s + CL])
            prefix = torch.cat([prompts, y[:, :s]], dim=1)
            att = torch.cat([prompt_att, torch.ones_like(y[:, :s], dtype=torch.bool)], dim=1)
            guess = None
            if self.cfg.self_conditioning:
                with torch.no_grad():
                    guess = block_logits(policy, prefix, att, canvas)
            logits = block_logits(policy, prefix, att, canvas, guess)
            logp = torch.log_softmax(logits, dim=-1)
            lp = logp.gather(-1, y[:, s:s + CL].unsqueeze(-1)).squeeze(-1)
            token_logp = token_logp.to(lp.dtype)
            token_logp[:, s:s + CL] = lp * m
            if token_ent is not None:
                token_ent = token_ent.to(lp.dtype)
                token_ent[:, s:s + CL] = entropy_of(logp)
            value = value.to(lp.dtype) + masked_estimate(lp, m, v.sum(dim=-1))
        if self.reduce == "mean":
            value = value / valid.sum(dim=-1).clamp(min=1)
        ent = None if token_ent is None else mean_over(token_ent, masks)
        return SequenceLogProb(value, token_logp, masks, valid, ent)

    def kl(self, new: LogProb, ref: LogProb) -> Tensor:
        """k3 estimate of KL(pi_theta || pi_ref) per sample (`likelihood.k3_kl`)."""
        return k3_kl(new, ref)
