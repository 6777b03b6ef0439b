"""Which device a buffer lives on, named the same way in every process, and routing by it.

A CUDA device index means nothing across processes: Ray gives each actor its own
`CUDA_VISIBLE_DEVICES`, so "cuda:0" is a different GPU in each. A GPU's UUID is the same
everywhere, so a CUDA IPC handle names its GPU by UUID (`shared_buffers`), and a receiver maps it
only if that GPU is one it sees. A process's identity for colocated sync is (node id, device):
the GPU's UUID, or "cpu" for host memory (every process on a node shares it).

`pair_colocated` is the routing rule: a receiver is fed through shared buffers only by a sender
of the same identity. The controller computes each actor's identity inside that actor
(`device_identity`) and pairs them before the first sync.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import NamedTuple, TypeVar

import torch

CPU = "cpu"


class DeviceIdentity(NamedTuple):
    node: str  # the host (Ray's node id, or any name unique per host)
    device: str  # a GPU's UUID, or "cpu"


def device_uuid(device: torch.device | str) -> str:
    """The UUID of the GPU `device` is in this process ("cpu" for host memory)."""
    device = torch.device(device)
    if device.type == "cpu":
        return CPU
    if device.type != "cuda":
        raise ValueError(f"weight sync buffers live on cpu or cuda devices, not {device}")
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


def visible_gpus() -> dict[str, int]:
    """UUID -> this process's index, for every GPU this process sees."""
    if not torch.cuda.is_available():
        return {}
    return {
        str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())
    }


def device_identity(node: str, device: torch.device | str) -> DeviceIdentity:
    """This process's identity for colocated sync; call it inside the process in question."""
    return DeviceIdentity(node, device_uuid(device))


S = TypeVar("S", bound=Hashable)
R = TypeVar("R", bound=Hashable)


def pair_colocated(
    senders: Mapping[S, DeviceIdentity], receivers: Mapping[R, DeviceIdentity]
) -> dict[S, tuple[R, ...]]:
    """The receivers each sender feeds through shared buffers: every receiver goes to the first
    sender (in `senders` order) with an equal identity. Every sender is a key, possibly with no
    receivers. On CPU every process of a node shares the identity (node, "cpu"), so the first
    sender listed on a node feeds all of its receivers.

    Raises ValueError for a receiver that no sender shares an identity with: on GPU that is an
    engine whose GPU holds no trainer rank, and a handle sent to it could not be opened there."""
    first: dict[DeviceIdentity, S] = {}
    for sender, identity in senders.items():
        first.setdefault(identity, sender)
    routes: dict[S, list[R]] = {sender: [] for sender in senders}
    for receiver, identity in receivers.items():
        if identity not in first:
            raise ValueError(
                f"colocated weight sync: receiver {receiver!r} is on {_describe(identity)}, where "
                f"no sender is (senders: {', '.join(_describe(i) for i in first) or 'none'}); "
                "every engine must share its GPU (or, on CPU, its node) with a trainer rank"
            )
        routes[first[identity]].append(receiver)
    return {sender: tuple(found) for sender, found in routes.items()}


def _describe(identity: DeviceIdentity) -> str:
    where = "host memory" if identity.device == CPU else f"GPU {identity.device}"
    return f"{where} of node {identity.node}"
