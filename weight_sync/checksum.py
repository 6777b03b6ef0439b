"""Checksums of tensor bytes, to verify every bucket on both sides of a transfer.

Three algorithms, chosen by where the bytes live and what this host can run, and recorded in the
manifest so both sides compute the same one:

* ``wxh64`` (CPU tensors, the default where a C compiler exists): a sum of keyed, bijectively
  mixed 64-bit words with a final avalanche (spec below). The native kernel (native/wxh64.c)
  computes it while it copies a tensor into its bucket: one read and one write per byte instead
  of a copy followed by a second read to hash. Large tensors are split across threads (ctypes
  releases the GIL). `wxh64_reference` is an independent numpy implementation.
* ``xxh3`` (CPU tensors without the native kernel): XXH3-64 of the raw bytes via python-xxhash,
  ~9-14 GB/s on one core here, computed in a separate pass after the copy.
* ``wsum64`` (GPU tensors): sum(w_i * (i mod 65521 + 1)) + sum(w_i) over the 16-bit words w_i,
  in int64 arithmetic that wraps identically everywhere; position sensitive, so swapped or
  shifted words change it, and it runs at device bandwidth without a copy to the host.

wxh64, exactly: the bytes are read as little-endian 64-bit words w_j (the last one zero-padded),
j = 0, 1, ...; with all arithmetic mod 2^64,

    d_j  = w_j ^ ((j + 1) * P1)          position key: swapped or shifted words change it
    d_j ^= lo32(lo32(d_j) * M1) << 32     two Feistel rounds: d_j is a bijection of w_j, so any
    d_j ^= lo32(hi32(d_j) * M2)           change confined to one word (every single flipped bit)
    V    = sum_j d_j                      changes V, hence the hash: guaranteed, not likely
    hash = fmix64(V ^ (nbytes * P4))      murmur3's 64-bit finalizer (a bijection)

None is cryptographic: they catch torn, stale or misplaced buffers, not adversaries.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from weight_sync import native

_CHUNK = 1 << 24        # words per step: bounds the int64 temporaries
_PRIME = 65521

P1, M1, M2, P4 = 0x9E3779B97F4A7C15, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F165667C5
_MASK64 = (1 << 64) - 1

# Large tensors are copied/hashed in chunks of about _CHUNK_BYTES that the calling thread and up
# to _THREADS - 1 helpers claim one at a time: one core alone does not saturate this box's memory
# bandwidth (wxh64 over DRAM: 1 thread 13 GB/s, 2 threads 22 GB/s), and claiming chunks instead of
# taking fixed halves keeps a helper that the OS has not scheduled off the critical path (on a
# busy 2-core box a fixed split, like torch's two-thread copy_, can run 4x slower than one thread).
_THREADS = max(1, min(4, os.cpu_count() or 1))
_CHUNK_BYTES = 4 << 20
_pool: ThreadPoolExecutor | None = None


def algorithm_for(tensor: torch.Tensor) -> str:
    if tensor.device.type != "cpu":
        return "wsum64"
    return "wxh64" if native.kernel() is not None else "xxh3"


def checksum(tensor: torch.Tensor, algorithm: str | None = None) -> int:
    algorithm = algorithm or algorithm_for(tensor)
    flat = tensor.detach().reshape(-1)
    if algorithm == "wxh64":
        if flat.device.type != "cpu":
            flat = flat.cpu()
        flat = flat.contiguous()
        nbytes = flat.numel() * flat.element_size()
        if native.kernel() is None:
            return wxh64_reference(flat.view(torch.uint8).numpy())
        return _finalize(_native_sum(flat.data_ptr(), None, nbytes), nbytes)
    if algorithm == "xxh3":
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return xxhash.xxh3_64_intdigest(memoryview(flat.view(torch.uint8).numpy()))
    if algorithm == "wsum64":
        return _weighted_word_sum(flat)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor, algorithm: str) -> int:
    """dst.copy_(src) for a 1-D `dst` of src's numel and dtype, and the checksum of the copied
    bytes (0 for algorithm "none"). One pass over the bytes where the native kernel can do it."""
    if (dst.device.type == "cpu" and src.device.type == "cpu" and algorithm in ("wxh64", "none")
            and src.dtype == dst.dtype and src.is_contiguous() and dst.is_contiguous()
            and native.kernel() is not None):
        nbytes = src.numel() * src.element_size()
        # Streaming stores: the bucket is read next by the receiver, not by this core.
        v = _native_sum(src.data_ptr(), dst.data_ptr(), nbytes)
        return _finalize(v, nbytes) if algorithm == "wxh64" else 0
    dst.copy_(src.reshape(-1))
    return 0 if algorithm == "none" else checksum(dst, algorithm)


def _native_sum(src: int, dst: int | None, nbytes: int) -> int:
    """wxh64's V over [src, src + nbytes), copying to dst (streaming stores) if given."""
    lib = native.kernel()
    chunks = max(1, nbytes // _CHUNK_BYTES)
    if chunks == 1 or _THREADS == 1:
        return lib.wxh64_sum(src, nbytes, 0) if dst is None else lib.wxh64_copy_sum(src, dst, nbytes, 0, 1)
    # Cut at multiples of 64 bytes (whole words and cache lines); chunk k starts at word cuts[k] / 8.
    cuts = [nbytes * k // chunks // 64 * 64 for k in range(chunks)] + [nbytes]
    return _ChunkedJob(lib, src, dst, cuts).run()


class _ChunkedJob:
    def __init__(self, lib, src: int, dst: int | None, cuts: list[int]):
        self.lib, self.src, self.dst, self.cuts = lib, src, dst, cuts
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.next = 0
        self.remaining = len(cuts) - 1
        self.total = 0

    def work(self) -> None:
        lib, src, dst, cuts = self.lib, self.src, self.dst, self.cuts
        while True:
            with self.lock:
                k = self.next
                if k >= len(cuts) - 1:
                    return
                self.next = k + 1
            start, size = cuts[k], cuts[k + 1] - cuts[k]
            if dst is None:
                v = lib.wxh64_sum(src + start, size, start // 8)
            else:
                v = lib.wxh64_copy_sum(src + start, dst + start, size, start // 8, 1)
            with self.lock:
                self.total = (self.total + v) & _MASK64
                self.remaining -= 1
                if self.remaining == 0:
                    self.done.set()

    def run(self) -> int:
        global _pool
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS - 1, thread_name_prefix="wxh64")
        for _ in range(min(_THREADS - 1, len(self.cuts) - 2)):
            _pool.submit(self.work)
        self.work()
        self.done.wait()     # late helpers find no chunk left and return; nobody waits for them
        return self.total


def _fmix64(k: int) -> int:
    k ^= k >> 33
    k = (k * 0xFF51AFD7ED558CCD) & _MASK64
    k ^= k >> 33
    k = (k * 0xC4CEB9FE1A85EC53) & _MASK64
    return k ^ (k >> 33)


def _finalize(v: int, nbytes: int) -> int:
    return _fmix64((v ^ (nbytes * P4)) & _MASK64)


def wxh64_reference(data) -> int:
    """wxh64 of a bytes-like object or uint8 array, in numpy (the spec above, no native code)."""
    raw = bytes(memoryview(data).cast("B")) if not isinstance(data, bytes) else data
    nbytes = len(raw)
    words = np.frombuffer(raw + bytes(-nbytes % 8), dtype="<u8").astype(np.uint64)
    j = np.arange(1, words.size + 1, dtype=np.uint64)
    d = words ^ (j * np.uint64(P1))
    low = np.uint64(0xFFFFFFFF)
    d ^= ((d & low) * np.uint64(M1) & low) << np.uint64(32)
    d ^= ((d >> np.uint64(32)) * np.uint64(M2)) & low
    return _finalize(int(d.sum(dtype=np.uint64)), nbytes)


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
