"""The continuous-batching scheduler and its managers (see `scheduler.py`)."""

from rollout.scheduler.pages import PageAllocator
from rollout.scheduler.parked import ParkedKV, ParkedKVStore
from rollout.scheduler.scheduler import ScheduledBatch, Scheduler
from rollout.scheduler.stats import SchedulerStats

__all__ = [
    "PageAllocator",
    "ParkedKV",
    "ParkedKVStore",
    "ScheduledBatch",
    "Scheduler",
    "SchedulerStats",
]
