"""Checksums of tensor bytes, to verify every bucket on both sides of a transfer.

Two algorithms, chosen by where the bytes live and recorded in the manifest so both sides
compute the same one:

* ``xxh3`` (CPU tensors): XXH3-64 of the raw bytes, ~9 GB/s per core here (twice a memcpy;
  zlib's CRC-32 ran at 2.5 GB/s and made verification cost more than the transfer).
* ``wsum64`` (GPU tensors): sum(w_i * (i mod 65521 + 1)) + sum(w_i) over the 16-bit words w_i,
  in int64 arithmetic that wraps identically everywhere; position sensitive, so swapped or
  shifted words change it, and it runs at device bandwidth without a copy to the host.

Neither is cryptographic: they catch torn, stale or misplaced buffers, not adversaries.
"""

from __future__ import annotations

import torch
import xxhash

_CHUNK = 1 << 24        # words per step: bounds the int64 temporaries
_PRIME = 65521


def algorithm_for(tensor: torch.Tensor) -> str:
    return "xxh3" if tensor.device.type == "cpu" else "wsum64"


def checksum(tensor: torch.Tensor, algorithm: str | None = None) -> int:
    algorithm = algorithm or algorithm_for(tensor)
    flat = tensor.detach().reshape(-1)
    if algorithm == "xxh3":
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return xxhash.xxh3_64_intdigest(memoryview(flat.view(torch.uint8).numpy()))
    if algorithm == "wsum64":
        return _weighted_word_sum(flat)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def _weighted_word_sum(flat: torch.Tensor) -> int:
    words = flat.view(torch.uint8)
    if words.numel() % 2:
        raise TypeError(f"wsum64 expects 16/32/64-bit elements, got {flat.dtype}")
    words = words.view(torch.int16)
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    positions = torch.arange(_CHUNK, dtype=torch.int64, device=flat.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start:start + _CHUNK].to(torch.int64)
        weights = (positions[:chunk.numel()] + start) % _PRIME + 1
        total += (chunk * weights).sum() + chunk.sum()
    return int(total)
