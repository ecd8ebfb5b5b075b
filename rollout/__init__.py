"""Generation with per-step log-probabilities (no Ray here)."""
from steadyrl.rollout.batch import RolloutBatch
from steadyrl.rollout.config import DDIMSamplerConfig, FlowSDESamplerConfig, SamplerConfig, SchedulerConfig, UNetConfig
from steadyrl.rollout.sampler import GaussianStepSampler, StepDistribution, StepLogProb
from steadyrl.rollout.sampler_factory import build_sampler

__all__ = ["RolloutBatch", "DDIMSamplerConfig", "FlowSDESamplerConfig", "SamplerConfig", "SchedulerConfig",
           "UNetConfig", "GaussianStepSampler", "StepDistribution", "StepLogProb", "build_sampler"]
