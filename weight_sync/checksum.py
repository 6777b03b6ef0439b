"""Checksums of tensor bytes, to verify every bucket on both sides of a transfer.

Three algorithms, chosen by where the bytes live and what this host can run, and recorded in the
manifest so both sides compute the same one:

* ``wxh64`` (CPU tensors, the default where a C compiler exists): a sum of keyed, bijectively
  mixed 64-bit words with a final avalanche (spec below). The native kernel (native/wxh64.c)
  computes it while it copies a tensor into its bucket: one read and one write per byte instead
  of a copy followed by a second read to hash. A bucket's tensors are hashed (or copied and
  hashed) as one job split across threads (ctypes releases the GIL). `wxh64_reference` is an
  independent numpy implementation.
* ``xxh3`` (CPU tensors without the native kernel): XXH3-64 of the raw bytes via python-xxhash,
  ~9-14 GB/s on one core here, computed in a separate pass after the copy.
* ``wsum64`` (GPU tensors): sum(w_i * (i mod 65521 + 2)) over the signed 16-bit words w_i,
  mod 2^64; position sensitive, so swapped or shifted words change it, and it runs on the device
  without a copy to the host. Each product fits int32 exactly (|w_i| <= 2^15, weight <= 65522,
  product < 2^31), so the device multiplies int16 words by a cached int32 weight vector (no
  modulo, no int64 copies of the words: about 7 bytes of memory traffic per weight byte) and
  sums in int64. A bucket's tensors are summed on the device and read back together: one host
  sync per bucket, however many tensors it holds.

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

_PRIME = 65521
# wsum64 words per step: bounds the int32 temporaries, and is a multiple of the weights' period
# so that one cached weight vector serves every chunk of every tensor.
_CHUNK = 32 * _PRIME
_word_weights: dict[torch.device, torch.Tensor] = {}

P1, M1, M2, P4 = 0x9E3779B97F4A7C15, 0x85EBCA77, 0xC2B2AE3D, 0x27D4EB2F165667C5
_MASK64 = (1 << 64) - 1

# A bucket's tensors are copied/hashed as one job: cut into pieces of at most _PIECE_BYTES that
# the calling thread and up to _THREADS - 1 helpers claim one at a time. One core alone does not
# saturate this box's memory bandwidth (wxh64 over DRAM: 1 thread 13 GB/s, 2 threads 22 GB/s);
# one job per bucket wakes the helpers once, not once per tensor, and claiming pieces instead of
# taking fixed halves keeps a helper that the OS has not scheduled yet off the critical path (on a
# busy 2-core box a fixed split, like torch's two-thread copy_, can run 4x slower than one thread).
_THREADS = max(1, min(4, os.cpu_count() or 1))
_PIECE_BYTES = 2 << 20
# Smaller jobs run on the calling thread alone: below 1 MiB waking a helper costs more than it
# saves, and a bucket this small is one of a stream that the sender and the receiver process in
# parallel (`ColocatedSender` with small buckets), each already on its own core, where a helper
# only competes with the other process.
_INLINE_BYTES = 32 << 20
# A bucket up to this size is packed with ordinary stores, so that it is still in the shared
# last-level cache when the receiver's core verifies it and copies it out (streamed buckets,
# `weight_sync.STREAM_BUCKET_BYTES`); a larger one would only evict it on the way, so its stores
# stream past the cache (no read of each destination line first).
_CACHED_STORE_BYTES = 16 << 20
_pool: ThreadPoolExecutor | None = None


def algorithm_for(tensor: torch.Tensor) -> str:
    if tensor.device.type != "cpu":
        return "wsum64"
    return "wxh64" if native.kernel() is not None else "xxh3"


def checksum(tensor: torch.Tensor, algorithm: str | None = None) -> int:
    algorithm = algorithm or algorithm_for(tensor)
    if algorithm == "wxh64":
        return checksums([tensor], algorithm)[0]
    flat = tensor.detach().reshape(-1)
    if algorithm == "xxh3":
        if flat.device.type != "cpu":
            flat = flat.cpu()
        return xxhash.xxh3_64_intdigest(memoryview(flat.view(torch.uint8).numpy()))
    if algorithm == "wsum64":
        return _weighted_word_sums([flat])[0]
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def checksums(tensors: list[torch.Tensor], algorithm: str) -> list[int]:
    """checksum(t, algorithm) for each tensor; for wxh64, one multi-threaded pass over them all;
    for wsum64, one read back from the device for them all."""
    if algorithm == "wsum64":
        return _weighted_word_sums([t.detach().reshape(-1) for t in tensors])
    if algorithm != "wxh64":
        return [checksum(t, algorithm) for t in tensors]
    flats = [_cpu_contiguous(t) for t in tensors]
    if native.kernel() is None:  # a receiver without the kernel still verifies, slowly
        return [wxh64_reference(f.view(torch.uint8).numpy()) for f in flats]
    sizes = [f.numel() * f.element_size() for f in flats]
    sums = _native_job([(f.data_ptr(), None, n) for f, n in zip(flats, sizes)])
    return [_finalize(v, n) for v, n in zip(sums, sizes)]


def copy_with_checksums(
    pairs: list[tuple[torch.Tensor, torch.Tensor]], algorithm: str
) -> list[int]:
    """dst.copy_(src) for each (dst, src), dst a 1-D tensor of src's numel and dtype, and the
    checksum of the bytes copied (0 for algorithm "none"). On CPU with the native kernel: one pass
    over the bytes, hashed as they stream, all pairs in one job (multi-threaded if large): stored
    past the cache when they exceed `_CACHED_STORE_BYTES` (the receiver's core reads them next,
    not this one), into the cache otherwise (the receiver finds them in the shared cache).
    Elsewhere: copy, then hash the copies (`checksums`: on a GPU, one host sync for all of
    them)."""
    on_cpu = algorithm in ("wxh64", "none") and any(dst.device.type == "cpu" for dst, _ in pairs)
    lib = native.kernel() if on_cpu else None  # GPU buffers: the torch copy + wsum64, as before
    results: list[int] = [0] * len(pairs)
    segments, slots, copied = [], [], []
    for i, (dst, src) in enumerate(pairs):
        if (
            lib is not None
            and dst.device.type == "cpu"
            and src.device.type == "cpu"
            and src.dtype == dst.dtype
            and src.is_contiguous()
            and dst.is_contiguous()
        ):
            segments.append((src.data_ptr(), dst.data_ptr(), src.numel() * src.element_size()))
            slots.append(i)
        else:
            dst.copy_(src.reshape(-1))
            if algorithm != "none":
                copied.append(i)
    if copied:
        for i, value in zip(copied, checksums([pairs[i][0] for i in copied], algorithm)):
            results[i] = value
    if segments:
        sums = _native_job(segments, sum(n for _, _, n in segments) > _CACHED_STORE_BYTES)
        if algorithm == "wxh64":
            for i, v, (_, _, n) in zip(slots, sums, segments):
                results[i] = _finalize(v, n)
    return results


def _cpu_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().reshape(-1)
    return (flat if flat.device.type == "cpu" else flat.cpu()).contiguous()


def _native_job(segments: list[tuple[int, int | None, int]], nontemporal: bool = True) -> list[int]:
    """wxh64's partial sum V of each (src, dst or None, nbytes) segment, copying src to dst where
    dst is given (`nontemporal`: with streaming stores). Segments are cut at multiples of 64
    bytes (whole words and cache lines); a piece at byte `start` of its segment begins at word
    start / 8."""
    lib = native.kernel()
    if sum(n for _, _, n in segments) < _INLINE_BYTES or _THREADS == 1:
        # One thread: a call per segment, none of the shared job's pieces, lock and event (a
        # streamed bucket is hashed once by the sender and once by the receiver, each the
        # critical path of its side).
        mode = int(nontemporal)
        return [
            lib.wxh64_sum(src, n, 0) if dst is None else lib.wxh64_copy_sum(src, dst, n, 0, mode)
            for src, dst, n in segments
        ]
    pieces = []
    for index, (_, _, nbytes) in enumerate(segments):
        count = max(1, -(-nbytes // _PIECE_BYTES))
        cuts = [nbytes * k // count // 64 * 64 for k in range(count)] + [nbytes]
        pieces.extend((index, cuts[k], cuts[k + 1] - cuts[k]) for k in range(count))
    job = _Job(lib, segments, pieces, int(nontemporal))
    helpers = min(_THREADS - 1, len(pieces) - 1)
    if helpers:
        global _pool
        if _pool is None:
            _pool = ThreadPoolExecutor(_THREADS - 1, thread_name_prefix="wxh64")
        for _ in range(helpers):
            _pool.submit(job.work)
    job.work()
    job.done.wait()  # late helpers find no piece left and return; nobody waits for them
    if job.error is not None:
        raise job.error
    return job.sums


class _Job:
    def __init__(self, lib, segments, pieces, nontemporal: int):
        self.lib, self.segments, self.pieces = lib, segments, pieces
        self.nontemporal = nontemporal
        self.sums = [0] * len(segments)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.next = 0
        self.remaining = len(pieces)
        self.error: BaseException | None = None
        if not pieces:
            self.done.set()

    def work(self) -> None:
        lib, segments, pieces = self.lib, self.segments, self.pieces
        while True:
            with self.lock:
                k = self.next
                if k >= len(pieces):
                    return
                self.next = k + 1
            index, start, size = pieces[k]
            src, dst, _ = segments[index]
            try:
                if dst is None:
                    v = lib.wxh64_sum(src + start, size, start // 8)
                else:
                    v = lib.wxh64_copy_sum(
                        src + start, dst + start, size, start // 8, self.nontemporal
                    )
            except BaseException as e:  # noqa: BLE001 -- handed to the caller, who waits on `done`
                self.error = e
                self.done.set()
                return
            with self.lock:
                self.sums[index] = (self.sums[index] + v) & _MASK64
                self.remaining -= 1
                if self.remaining == 0:
                    self.done.set()


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


def _weights(device: torch.device, n: int) -> torch.Tensor:
    """(k mod 65521) + 2 for k < n <= _CHUNK, int32 on `device`, cached (grown on demand)."""
    cached = _word_weights.get(device)
    if cached is None or cached.numel() < n:
        k = torch.arange(n, dtype=torch.int64, device=device)
        cached = _word_weights[device] = (k % _PRIME + 2).to(torch.int32)
    return cached[:n]


def _weighted_word_sums(flats: list[torch.Tensor]) -> list[int]:
    """wsum64 of each 1-D tensor, all on one device: summed there, read back once."""
    if not flats:
        return []
    sums = []
    for flat in flats:
        words = flat.view(torch.uint8)
        if words.numel() % 2:
            raise TypeError(f"wsum64 expects 16/32/64-bit elements, got {flat.dtype}")
        words = words.view(torch.int16)
        weights = _weights(flat.device, min(words.numel(), _CHUNK))
        # chunks start at multiples of _CHUNK, a multiple of the weights' period
        parts = [
            torch.mul(chunk, weights[: chunk.numel()]).sum()  # int16 * int32 -> int32, sum int64
            for chunk in words.split(_CHUNK)
        ]
        if not parts:
            sums.append(torch.zeros((), dtype=torch.int64, device=flat.device))
        else:
            sums.append(parts[0] if len(parts) == 1 else torch.stack(parts).sum())
    return torch.stack(sums).tolist()  # the one host sync
