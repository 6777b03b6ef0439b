"""Rollouts: rollout functions, trajectories, the tool loop and tools, the rollout manager,
over-sampling and the asynchronous producer."""
