"""Runnable RL examples that train through the rollout service (see README: Recipes)."""
