"""Generation with per-step log-probabilities (no Ray here)."""
from rollout.batch import RolloutBatch
from rollout.config import DDIMSamplerConfig, FlowSDESamplerConfig, SamplerConfig, SchedulerConfig, UNetConfig
from rollout.sampler import GaussianStepSampler, StepDistribution, StepLogProb
from rollout.samplers import build_sampler

__all__ = ["RolloutBatch", "DDIMSamplerConfig", "FlowSDESamplerConfig", "SamplerConfig", "SchedulerConfig",
           "UNetConfig", "GaussianStepSampler", "StepDistribution", "StepLogProb", "build_sampler"]
