"""Observers of what weight sync asks of a device, for tests on a CPU.

`RecordingOps` stands where a `DeviceOps` does: it logs each call and passes it on to the real
one (on a CPU its calls are no-ops). `TorchCalls` logs, through torch's own function-mode hook,
every tensor copy and every call that reads a tensor's value back to the host (on a GPU each is
a host sync).
"""

from __future__ import annotations

from torch.overrides import TorchFunctionMode

HOST_READS = frozenset(
    {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy", "nonzero"}
)


class RecordingOps:
    def __init__(self, log: list):
        from weight_sync import DeviceOps

        self.log = log
        self.ops = DeviceOps()

    def synchronize(self, device) -> None:
        self.log.append("sync")
        self.ops.synchronize(device)


class TorchCalls(TorchFunctionMode):
    """Appends "fill" for each `Tensor.copy_` and "host_read" for each host read to `log`."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "copy_":
            self.log.append("fill")
        elif name in HOST_READS:
            self.log.append("host_read")
        return func(*args, **(kwargs or {}))
