"""Generation with per-step log-probabilities (no Ray here)."""
from rollout.batch import RolloutBatch
from rollout.config import SamplerConfig, SchedulerConfig, UNetConfig
from rollout.ddim import DDIMLogProbSampler

__all__ = ["RolloutBatch", "SamplerConfig", "SchedulerConfig", "UNetConfig", "DDIMLogProbSampler"]
