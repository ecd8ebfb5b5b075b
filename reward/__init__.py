"""Reward functions, ensembles, uncertainty and diversity (no Ray here)."""
from reward.base import RewardModel
from reward.ensemble import EnsembleScores, RewardEnsemble, combine_scores

__all__ = ["RewardModel", "RewardEnsemble", "EnsembleScores", "combine_scores"]
