"""The device calls that order a colocated transfer between two processes.

CUDA copies are asynchronous: when `copy_` returns the copy is enqueued, not done. In the
colocated transport two processes use one buffer and no CUDA stream orders one process's work
after the other's, so two points of the protocol wait for their own device work to finish:

* the sender, after filling a bucket and before its handle leaves: otherwise the receiver may
  read a half-written bucket (its checksums would usually catch it; with verification off,
  nothing would);
* the receiver, after its copies out of a bucket and before its acknowledgement: otherwise the
  sender may refill the buffer, or the mapping be closed, under a copy still in flight.

On CPU a copy is done when it returns, so the same calls are no-ops. Both sides take a
`DeviceOps` so a test can observe the order of these calls on a CPU.
"""

from __future__ import annotations

import torch


class DeviceOps:
    def synchronize(self, device: torch.device) -> None:
        """Block until all work queued on `device` by this process has finished."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
