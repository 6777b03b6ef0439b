"""`python -m held_open_train RECIPE [key=value ...]`: `python -m miles_like.train` whose fully
asynchronous producer (single-turn) holds one group open at every checkpoint, so that the
checkpoint always shows what a resume does with an open group's tokens. With `rollout.partial:
in_place` the group is released at the update before a checkpoint (the only one that aborts);
with retract (the default) at every update, each of which aborts.

An engine faster than the trainer fills the buffer: at a checkpoint's update nothing runs, and
no open group has tokens. Here one fresh group is kept back (drawn, not sent; it takes a room
of the buffer, so give the run one room more than its batches need) until the update before the
next checkpoint. There its first request samples one token per sample (`max_new_tokens=1`,
`ignore_eos`) and comes back unfinished, as an abort leaves a sample (its finish reason is the
abort's: the cut was this hook's, not the recipe's budget); its continuation is sent, and the
update's abort stops it. The checkpoint then holds the group open, with tokens of the weights
the update replaces (one version old: not stale). The engines, the tokens, their log-probs and
versions are all real.

With `continued_first` (retract), the cut group is also the first group of the update's batch
to be generated after it: fresh groups wait until it is complete. With `cluster.take_ahead:
false` (a batch is taken after the update, as when generating one outlasts training one) and
only the default buffer (prompts_per_step x 2 rooms at max_staleness 1, the kept-back group
taking one), at most prompts_per_step - 1 other groups can complete before it: the batch taken
after each update holds the cut group, continued over the update, whatever the engines' speed.
(Taken ahead, no batch could complete while a step trains, the kept-back group holding its
room, and the take would find nothing generating.)

Run as the killed run of `test_async_in_place_e2e.py` and `test_async_e2e.py`
(`killed_run(..., module=...)`); in the test's own process with `held_open(...)`
(`test_async_prefill_decode_e2e.py`).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

# With `held_open(continued_first=True)`: the overrides under which the batch taken after each
# update holds the group held open over it (the module doc), and what such a run shows.
AHEAD_BY_ONE = ("cluster.max_staleness=1", "cluster.take_ahead=false")


def assert_ran_ahead_by_one(rows: list[dict]) -> None:
    """Within one step of staleness, some batch one version old, and every batch after the
    first holding a group continued over an update."""
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert any(r["rollout/staleness_max"] == 1 for r in rows[1:])
    assert sum(r["rollout/continued_groups"] for r in rows) > 0
    assert all(r["rollout/continued_groups"] >= 1 for r in rows[1:])


class Hold:
    index: int | None = None  # the group kept back
    cut: int | None = None  # the group whose first request is cut after one token
    continued_first: bool = False  # fresh groups wait while the cut group continues


def install(continued_first: bool = False) -> None:
    from miles_like.rollouts.async_producer import AsyncProducer
    from miles_like.rollouts.async_producer.sending import Sender
    from miles_like.rollouts.partial import ABORTED

    Hold.index, Hold.cut, Hold.continued_first = None, None, continued_first
    waiting, requests, deliver = Sender.waiting, Sender.requests, Sender.deliver
    pause = AsyncProducer.pause

    def continuing(ledger) -> bool:
        """The cut group is open with the token its first request sampled."""
        slot = ledger.open.get(Hold.cut) if Hold.cut is not None else None
        return slot is not None and bool(slot.group.samples)

    def held_waiting(self) -> list[int]:
        out = waiting(self)
        if Hold.continued_first and continuing(self.ledger):  # fresh groups wait for it
            return [i for i in out if self.ledger.open[i].group.samples]
        if Hold.index is None:  # the lowest fresh group waiting
            fresh = [i for i in out if not self.ledger.open[i].group.samples and i != Hold.cut]
            Hold.index = fresh[0] if fresh else None
        return [i for i in out if i != Hold.index]

    def cut_requests(self, slot):
        out = requests(self, slot)
        if slot.index != Hold.cut or slot.group.samples:
            return out
        cut = [(p, dataclasses.replace(s, max_new_tokens=1, ignore_eos=True), j) for p, s, j in out]
        return cut

    def cut_deliver(self, owner, samples, version, versions, replica):
        if owner[0] == Hold.cut and not self.ledger.open[owner[0]].group.samples:
            assert all(s.finish_reason == "length" and len(s.token_ids) == 1 for s in samples)
            samples = [s._replace(finish_reason=ABORTED) for s in samples]
        deliver(self, owner, samples, version, versions, replica)
        if Hold.continued_first and owner[0] == Hold.cut and Hold.cut not in self.ledger.open:
            self.fill()  # the cut group is complete: the fresh groups that waited are sent

    async def release(producer: AsyncProducer) -> None:
        """Send the held group; returns once its cut first request is back (with tokens)."""
        assert Hold.index is not None, "no fresh group was kept back for this checkpoint"
        i = Hold.cut = Hold.index
        Hold.index = None  # the next fill keeps back the next checkpoint's group
        producer.sender.fill()
        while not producer.ledger.open[i].group.samples:
            await asyncio.sleep(0.01)

    def held_pause(self, abort: bool = True) -> None:
        if abort:  # in_place aborts only before a checkpoint
            self._run(release(self))
        pause(self, abort)

    Sender.waiting = held_waiting
    Sender.requests = cut_requests
    Sender.deliver = cut_deliver
    AsyncProducer.pause = held_pause


@contextmanager
def held_open(continued_first: bool = False) -> Iterator[None]:
    """`install(continued_first)` for the runs of this block in this process, undone after."""
    from miles_like.rollouts.async_producer import AsyncProducer
    from miles_like.rollouts.async_producer.sending import Sender

    patched = [(Sender, n) for n in ("waiting", "requests", "deliver")] + [(AsyncProducer, "pause")]
    originals = [(cls, name, cls.__dict__[name]) for cls, name in patched]
    install(continued_first)
    try:
        yield
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
        Hold.index, Hold.cut, Hold.continued_first = None, None, False


if __name__ == "__main__":
    import sys

    from miles_like.recipe.cli import main

    install()
    sys.exit(main())
