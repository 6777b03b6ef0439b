"""Where every group the producer drew is, and what its parts share (all on the rollout loop).

Every drawn index is exactly one of: open (generating or waiting to be sent: `open`, or
`agents` with a multi-turn rollout function), buffered (complete), taken by the trainer until
its weight update, or dropped (stale, or aborted with `rollout.partial: abort`) / filtered
(dynamic sampling) and not yet reported. `held` and the reported ids make that checkable.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any, NamedTuple

from miles_like.rollouts.group_scoring import Group
from miles_like.rollouts.partial import OpenGroup


@dataclasses.dataclass
class GroupInProgress:
    """An open single-turn group: its samples so far, and its requests in flight."""

    index: int
    group: OpenGroup
    pending: int = 0  # its requests sent and not yet back
    sent_version: int = 0  # the weights when they were sent: none of their tokens is older
    wave: tuple[int, int, list[int]] | None = None  # (replica, wave id, request indices)

    @property
    def running(self) -> bool:
        return self.pending > 0


class BufferedGroup(NamedTuple):
    """A complete group in the buffer, scored (or being scored) on an executor thread."""

    index: int
    group: OpenGroup  # an agent group's: its problem and rollouts, no samples
    scored: asyncio.Future  # -> (Group, reward failure counts)
    oldest: int | None  # the oldest weight version of its tokens
    trajectories: list | None = None  # an agent group's (what a checkpoint saves)

    def lag(self, version: int) -> int:
        """Its staleness if trained at `version`."""
        return 0 if self.oldest is None else version - self.oldest


class AsyncBatch(NamedTuple):
    """One batch the trainer took."""

    groups: list[Group]  # in index order
    indices: list[int]
    staleness: list[int]  # per group, in versions
    continued: int  # groups of the batch that were continued over a weight update
    tallies: Counter  # reward failure counts
    seconds: float  # since the previous take (the window of the engine counters)
    engine: Counter  # the engines' counter deltas over that window
    buffered: int  # complete groups left in the buffer
    filtered: list[int] | None  # dynamic sampling: groups filtered since the previous take


@dataclasses.dataclass
class Ledger:
    """The drawn groups, by where they are (see the module's docstring)."""

    capacity: int  # open + buffered + taken never exceed it (back-pressure)
    open: dict[int, GroupInProgress] = dataclasses.field(default_factory=dict)
    agents: dict[int, Any] = dataclasses.field(default_factory=dict)  # -> agents.AgentGroup
    buffered: list[BufferedGroup] = dataclasses.field(default_factory=list)  # completion order
    # the indices of each batch taken by the trainer whose weight update is not in yet
    # (two while `take_ahead`'s batch waits for the step being trained)
    taken: list[list[int]] = dataclasses.field(default_factory=list)
    dropped: list[int] = dataclasses.field(default_factory=list)  # stale, since the last report
    aborted: list[int] = dataclasses.field(default_factory=list)  # unfinished, partial: abort
    # dynamic sampling: filtered since the last take (reported by the next one)
    filtered: list[int] = dataclasses.field(default_factory=list)

    def room(self) -> int:
        """How many more prompts may be drawn."""
        held = len(self.open) + len(self.agents) + len(self.buffered)
        return self.capacity - held - sum(map(len, self.taken))

    def held(self) -> list[int]:
        """Open, buffered, taken ahead (after the update, `taken` holds only that one), or
        filtered since the last take (the next take reports them)."""
        ahead = [i for batch in self.taken for i in batch]
        buffered = (b.index for b in self.buffered)
        return sorted([*self.open, *self.agents, *buffered, *self.filtered, *ahead])

    def report(self) -> tuple[list[int], list[int], list[int]]:
        """(stale, aborted) indices dropped since the last report, and the held ones at the
        same moment (with in_place, a group may be dropped at any time)."""
        out = (sorted(self.dropped), sorted(self.aborted), self.held())
        self.dropped, self.aborted = [], []
        return out


@dataclasses.dataclass
class Flow:
    """The producer's flow control, shared by its parts."""

    version: int = 0  # the engines' weights (what the controller last synced; a replacement's)
    accepting: bool = False  # from `resume` to `pause`: groups are drawn and sent
    window_open: bool = False  # the engines admit requests (in_place updates leave it open)
    failure: BaseException | None = None  # a wave's or a rollout function's: `take` raises it
    # set whenever a group completes or is filtered, a wave ends, or a function fails
    changed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    # agents' engine calls wait on it while work is not accepted
    wake: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    waves: set[asyncio.Task] = dataclasses.field(default_factory=set)  # running on engines

    def track(self, task: asyncio.Task) -> asyncio.Task:
        """`task` counts as a wave until it is done (`pause` waits for every wave)."""
        self.waves.add(task)
        task.add_done_callback(self.waves.discard)
        return task
