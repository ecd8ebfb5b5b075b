"""Reward functions, ensembles, uncertainty and diversity (no Ray here)."""
from steadyrl.reward.base import RewardModel
from steadyrl.reward.ensemble import EnsembleScores, RewardEnsemble, combine_scores

__all__ = ["RewardModel", "RewardEnsemble", "EnsembleScores", "combine_scores"]
