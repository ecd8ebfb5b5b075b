"""Build a sampler from its config's `kind` (the learner and the actors never name a concrete sampler)."""
from __future__ import annotations

from steadyrl.rollout.config import (AutoregressiveSamplerConfig, BlockDiffusionSamplerConfig, DDIMSamplerConfig,
                                    FlowSDESamplerConfig, MaskedDiffusionSamplerConfig, SamplerBase, SchedulerConfig)
from steadyrl.rollout.sampler import Sampler


def build_sampler(cfg: SamplerBase, scheduler: SchedulerConfig | None = None,
                  mask_token_id: int | None = None, eos_token_id: int | None = None,
                  pad_token_id: int | None = None, vocab_size: int | None = None) -> Sampler:
    """DDIM (epsilon model), flow-SDE (velocity model), masked diffusion (a masked LM and its tokenizer's
    mask, EOS and pad ids), autoregressive (a causal LM and its EOS and pad ids) or block diffusion (a DiffusionGemma,
    its vocabulary size and EOS and pad ids), by `cfg.kind`."""
    if isinstance(cfg, DDIMSamplerConfig):
        from steadyrl.rollout.ddim import DDIMLogProbSampler
        from steadyrl.rollout.models import build_scheduler

        return DDIMLogProbSampler(cfg, build_scheduler(scheduler or SchedulerConfig()))
    if isinstance(cfg, FlowSDESamplerConfig):
        from steadyrl.rollout.flow_sde import FlowSDESampler

        return FlowSDESampler(cfg, scheduler or SchedulerConfig())
    if isinstance(cfg, MaskedDiffusionSamplerConfig):
        from steadyrl.rollout.masked_diffusion import MaskedDiffusionSampler

        if mask_token_id is None:
            raise ValueError("sampler.kind='masked_diffusion' needs the model's mask token id")
        return MaskedDiffusionSampler(cfg, mask_token_id, eos_token_id, pad_token_id)
    if isinstance(cfg, AutoregressiveSamplerConfig):
        from steadyrl.rollout.autoregressive import AutoregressiveSampler

        if eos_token_id is None or pad_token_id is None:
            raise ValueError("sampler.kind='autoregressive' needs the tokenizer's EOS and pad token ids")
        return AutoregressiveSampler(cfg, eos_token_id, pad_token_id)
    if isinstance(cfg, BlockDiffusionSamplerConfig):
        from steadyrl.rollout.block_diffusion import BlockDiffusionSampler

        if eos_token_id is None or pad_token_id is None or vocab_size is None:
            raise ValueError("sampler.kind='block_diffusion' needs the model's vocabulary size and the tokenizer's EOS "
                             "and pad token ids")
        return BlockDiffusionSampler(cfg, vocab_size, eos_token_id, pad_token_id)
    raise ValueError(f"sampler.kind={getattr(cfg, 'kind', None)!r} is not a known sampler "
                     "(ddim, flow_sde, masked_diffusion, autoregressive, block_diffusion)")
