"""Objectives (GRPO and the stabilising family) and the DeepSpeed learner (no Ray here)."""
