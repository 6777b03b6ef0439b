"""Running a recipe: the RL loops, bring-up of the Ray actors, weight pushes, checkpoints,
timing and tracking."""
