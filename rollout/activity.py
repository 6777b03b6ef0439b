"""What an engine's step loop did, and when: the raw material of the busy / idle accounting.

Each forward pass (model forward + sampling, `Engine.step`) is one `ForwardPass`: its wall-clock
interval (`time.time()`, so intervals recorded in different processes, even on different
machines with synchronized clocks, are comparable), how many sequences it computed, and how many
samples it finished. The engine records into an `ActivityLog` only when its owner attached one
(`Engine.activity`); the owner drains it with `take()`, from any thread.
"""

from __future__ import annotations

import threading
from typing import NamedTuple


class ForwardPass(NamedTuple):
    start: float  # time.time() before the forward pass
    end: float  # time.time() after sampling (which waits for the device)
    sequences: int  # sequences computed in this pass (decoding and prefilling)
    finished: int  # samples that ended in this pass (stop or length, not aborts)


class ActivityLog:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._forwards: list[ForwardPass] = []

    def record(self, forward: ForwardPass) -> None:
        with self._lock:
            self._forwards.append(forward)

    def take(self) -> list[ForwardPass]:
        """Every forward recorded since the last `take`, oldest first."""
        with self._lock:
            out, self._forwards = self._forwards, []
        return out
