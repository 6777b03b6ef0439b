"""The rollout side of fully asynchronous training (`cluster.fully_async`): a producer that
keeps the engines generating into a bounded buffer while the trainer trains.

Groups are drawn from the prompt source in data order; group g is the g-th prompt the run drew
(its *index*, the data position). Its first request is one request of n samples seeded exactly
as the synchronous loop seeds that data position (step g // prompts_per_step, place g %
prompts_per_step), so what an engine is asked to do for a prompt does not depend on the mode.

* **Capacity** (`cluster.async_buffer_groups`, B): groups open (generating or waiting to be
  sent), complete in the buffer, and taken by the trainer until their weight update, together
  never exceed B; the producer draws new prompts only below it (back-pressure). A taken batch
  frees its room only once the weights it trained are in the engines, so with B =
  prompts_per_step x (K + 1) at most K batches' worth is generated under older weights.
* **Sending** (`sending.py`): newly drawn groups (and, after an update, the continued ones,
  index order) leave as one `EngineWorker.generate_wave` per replica, in contiguous shares.
* **The buffer** (`buffer.py`) holds complete groups in completion order, each scored as it
  completes; `take` gives the trainer the first prompts_per_step that are not stale, trained in
  index order. Completion order depends on timing: an async run is not bitwise reproducible,
  except at max_staleness 0, where one batch is generated at a time. Dynamic sampling filters
  groups with all rewards equal as soon as they are scored.
* **A weight update** (`update.py`: `pause`, then the controller syncs, then `drop_stale` and
  `resume`): retract, abort or in place (`rollout.partial`); groups too stale to be trained are
  dropped and counted, their prompts consumed and never drawn again.
* **An engine that dies** is replaced at the controller's next producer call, at the engines'
  weight version (`replacement.py`, within `cluster.max_engine_restarts`); its groups keep what
  they had delivered and are sent again.
* **Multi-turn rollout functions**: each open group is a task running the function
  (`rollouts/agents.py`), its engine calls continued from their tokens over an update.

Accounting (`ledger.py`): every drawn index is exactly one of trained, dropped (stale or
aborted), filtered (dynamic sampling), or held (open, buffered, being trained, or filtered and
not yet reported); `held_indices` with the trained / dropped / filtered ids of the rows makes
that checkable. `state` (`state.py`, taken between `pause` and `resume`, when no request runs)
holds the open groups with their tokens, log-probs and versions, and the buffer.
"""

from miles_like.rollouts.async_producer.facade import AsyncProducer
from miles_like.rollouts.async_producer.ledger import AsyncBatch
from miles_like.rollouts.rollout_metrics import batch_metrics

__all__ = ["AsyncBatch", "AsyncProducer", "batch_metrics"]
