"""The producer around a weight update: `pause`, (the controller syncs), `drop_stale`, `resume`.

* Retract (`rollout.partial: retract` or null): every running request is aborted
  (`close(abort_running=True)`) and comes back with the tokens it has; its group continues
  after the update, each unfinished sample as a request of its prompt + tokens so far. With
  `abort` the unfinished groups are dropped. Every token keeps the weight version that sampled
  it and its log-prob, which the loss's TIS / MIS correction uses as the behaviour policy.
* In place (`rollout.partial: in_place`): nothing is aborted, the engines park their step loops
  between two forward passes for the update, running requests keep their K/V and sample on with
  the new weights. After it, the requests sent more than max_staleness versions ago are aborted
  (`EngineWorker.cancel_wave`; their K/V is parked) and, once back, their group is dropped if
  its tokens are too old or continued on the parked K/V (`Sender.deliver`). Before a checkpoint
  the update is the retract one, so that the checkpoint holds every token.
* Open groups whose returned tokens are more than `cluster.max_staleness` versions old at the
  new version can never be trained: they are dropped and counted, their prompts consumed.
"""

from __future__ import annotations

import asyncio

from miles_like.rollouts.async_producer.ledger import Flow, Ledger
from miles_like.rollouts.async_producer.replacement import Replicas
from miles_like.rollouts.async_producer.sending import Sender


async def pause(flow: Flow, replicas: Replicas, abort: bool) -> None:
    """Stop sending; with `abort`, abort every running request and wait until all of them are
    back (without, `in_place`, they keep running through the update)."""
    flow.accepting = False
    flow.wake.clear()
    if not abort:  # in_place: requests run on through the update, which must reach every
        await replicas.replace_dead()  # replica (a dead one is replaced first)
        return
    while True:  # until every replica is closed and alive: the update reaches them all
        await replicas.on_every("close", True)
        flow.window_open = False
        if flow.waves:
            await asyncio.wait_for(asyncio.gather(*flow.waves), replicas.timeout)
        if not replicas.dead:
            return


async def drop_stale(
    ledger: Ledger, replicas: Replicas, version: int, max_staleness: int, keep_partial: bool
) -> None:
    """After the update to `version`: free the trained batch's room; drop the open groups whose
    returned tokens are too old (`keep_partial` false: every unfinished one); abort the
    requests running across the update that were sent more than max_staleness versions ago."""
    if ledger.taken:  # the trained batch's room is free
        ledger.taken.pop(0)
    check: dict[tuple[int, int], list[int]] = {}  # (replica, wave) -> requests to abort
    for i in sorted(ledger.open):
        slot = ledger.open[i]
        oldest = slot.group.oldest()
        if oldest is not None and version - oldest > max_staleness:
            ledger.dropped.append(i)
            del ledger.open[i]
            if slot.wave is not None:
                check.setdefault(slot.wave[:2], []).extend(slot.wave[2])
        elif not keep_partial and slot.group.samples:
            ledger.aborted.append(i)
            del ledger.open[i]
        else:
            if slot.running and version - slot.sent_version > max_staleness:
                check.setdefault(slot.wave[:2], []).extend(slot.wave[2])
            if slot.group.samples or slot.running:  # continued across this update
                slot.group = slot.group._replace(rollouts=slot.group.rollouts + 1)
    for i in sorted(ledger.agents):  # agent groups: no call runs (retract aborted them)
        group = ledger.agents[i]
        if group.oldest is not None and version - group.oldest > max_staleness:
            ledger.dropped.append(i)
        elif not keep_partial and group.oldest is not None:
            ledger.aborted.append(i)
        else:
            group.rollouts += group.oldest is not None
            continue
        del ledger.agents[i]
        if group.task is not None:
            group.task.cancel()
    if check:  # a replica that dies meanwhile is replaced at the next call (`resume`)
        await replicas.cancel_waves(check)


async def resume(flow: Flow, replicas: Replicas, sender: Sender) -> None:
    """Reopen the engines, draw prompts up to the capacity and send what waits."""
    if not flow.window_open:  # in_place updates leave it open: no round trip
        await replicas.on_every("open")
        flow.window_open = True
    elif replicas.dead:  # found dead by the update's staleness check (`cancel_wave`)
        await replicas.replace_dead()
    flow.accepting = True
    sender.fill()
