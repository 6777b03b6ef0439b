"""Rollouts: prompts -> scored groups of trajectories.

* the rollout-function API and built-ins: `context.py`, `functions.py`, `single_turn.py`,
  `tool_loop.py` (tools: `tools.py`), `trajectory.py`;
* a synchronous step: `manager.py` (`RolloutManager`), its requests batched per replica
  (`replica_batcher.py`), groups placed by `shares.py`, scored by `group_scoring.py`, measured
  by `rollout_metrics.py`; over-sampled and partial rollouts: `oversampling.py`, `partial.py`;
* fully asynchronous training: `async_producer/` (`AsyncProducer`), multi-turn functions in it:
  `agents.py`;
* an engine that dies mid-rollout: `engine_deaths.py`.
"""
