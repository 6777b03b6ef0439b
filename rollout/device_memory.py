"""The engine's dealings with the device allocator: giving freed memory back, and measuring what
is free.

torch's CUDA caching allocator keeps the blocks of freed tensors reserved for this process: after
the engine drops its KV pool, parameters and graphs, another process on the same GPU (the
colocated trainer) sees none of that memory until the cache is emptied. `return_freed` is the
one place the engine (rank 0 and every tensor-parallel follower) does that; on CPU the freed
tensors are already back with the process's allocator, and the call does nothing.
"""

from __future__ import annotations

import torch


def return_freed(device: torch.device) -> None:
    """Hand the blocks the caching allocator holds for freed tensors back to the device, once
    every queued kernel that might still read them has finished. Call after dropping the last
    reference to what is released. A no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def free_bytes(device: torch.device) -> int:
    """Memory another allocation on `device` could take now: the device's free memory on CUDA
    (what `return_freed` gave back included), the host's available memory on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil

    return psutil.virtual_memory().available
