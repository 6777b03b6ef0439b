"""The controller: `recipe/` (the recipe's sections, rules and CLI), `run/` (the RL loops, the
Ray actors, weight pushes, checkpoints), `rollouts/` (rollout functions, trajectories, tools,
over-sampling, the asynchronous producer), `scoring/` (rewards, shaping, advantages, the
trainer's batch), `models/` (built-in tiny models, tokenizers, the model store), `data.py` (the
prompt source) and `tasks/` (synthetic tasks)."""

from miles_like import moved_modules

moved_modules.install()
