"""Build a sampler from its config's `kind` (the learner and the actors never name a concrete sampler)."""
from __future__ import annotations

from rollout.config import DDIMSamplerConfig, FlowSDESamplerConfig, SamplerBase, SchedulerConfig
from rollout.sampler import GaussianStepSampler


def build_sampler(cfg: SamplerBase, scheduler: SchedulerConfig) -> GaussianStepSampler:
    """DDIM (epsilon model) or flow-SDE (velocity model), by `cfg.kind`."""
    if isinstance(cfg, DDIMSamplerConfig):
        from rollout.ddim import DDIMLogProbSampler
        from rollout.models import build_scheduler

        return DDIMLogProbSampler(cfg, build_scheduler(scheduler))
    if isinstance(cfg, FlowSDESamplerConfig):
        from rollout.flow_sde import FlowSDESampler

        return FlowSDESampler(cfg, scheduler)
    raise ValueError(f"sampler.kind={getattr(cfg, 'kind', None)!r} is not a known sampler (ddim, flow_sde)")
