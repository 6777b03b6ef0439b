"""The one error weight sync raises for a transfer it refuses or cannot complete."""

from __future__ import annotations


class WeightSyncError(RuntimeError):
    """A bucket failed its checksums, or a handle names memory this process cannot map."""
