"""The colocated hand-off over a local socket: one start call per sync, not one per bucket.

`ColocatedSender` hands each bucket over through `deliver(handle, manifest)`. Delivered as an
RPC per bucket (a Ray actor call), that costs a call's latency a bucket, so the buckets must be
large. Here the sender listens on a Unix socket of its own (`BucketStream`), the receiver's
process is asked once per sync to connect (`receive_stream`, started by one actor call in the RL
loop, by a pipe command in `benchmarks/weight_sync.py`), and every bucket's handle + manifest
then goes down that socket and its acknowledgement comes back up it. That makes small buckets
cheap: the sender packs bucket k+1 while the receiver verifies and loads bucket k, with buckets
the size of the cache (`STREAM_BUCKET_BYTES`, tensors split across them).

Guarantees, as with a call per bucket: the receiver verifies each bucket before loading any of
it (`BucketReceiver`) and answers each with an ack or the error that refused it; the sender
raises that error (`WeightSyncError`, naming the receiver) and stops. Every wait on the other
side is bounded by `timeout_s`; a peer that dies closes its end of the socket, which the other
side sees at once (`WeightSyncError`). A sync cut short (the sender stopped before its end
message) fails the receiver's call, and its split tensors keep the commit refused.

The socket lives in Linux's abstract namespace (no file to clean up; reachable from this host
only), named at random, and a receiver proves it was sent the address by writing the random
token that came with it first. Handles and manifests are pickled (as Ray would); the tensor
bytes never go through the socket.
"""

from __future__ import annotations

import os
import pickle
import secrets
import socket
import struct
import time
from collections.abc import Callable
from typing import NamedTuple

from weight_sync.colocated import BucketReceiver, LoadAck
from weight_sync.errors import WeightSyncError

# Buckets in flight on a stream: with three the sender may pack up to two buckets ahead of the
# receiver, so the pipeline absorbs the sync's changing pace (the sender's reads of the trainer's
# weights are slower where they come from memory, faster where the cache still holds them, while
# the receiver's share is steadier) instead of each side waiting on the other bucket by bucket.
STREAM_NUM_BUFFERS = 3
# A stream's buckets are verified and copied out while the last-level cache still holds them:
# all STREAM_NUM_BUFFERS in flight fit in half of it. Within these bounds (a power of two): below
# them the per-bucket hand-off costs more than the cache saves, above them nothing more was gained.
MIN_STREAM_BUCKET_BYTES, MAX_STREAM_BUCKET_BYTES = 4 << 20, 16 << 20


_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}  # sysfs cache sizes: "32768K"


def last_level_cache_bytes(cpu_dir: str = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the CPU's last-level cache as Linux reports it (its highest-level cache on
    cpu0), None where it does not (another OS, a container hiding /sys)."""
    sizes = {}
    try:
        for index in os.listdir(cpu_dir):
            if not index.startswith("index"):
                continue
            with open(os.path.join(cpu_dir, index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(cpu_dir, index, "size")) as f:
                text = f.read().strip()  # "32768K", "2048K", "1M"
            unit = _SIZE_UNITS.get(text[-1])
            size = int(text[:-1]) * unit if unit else int(text)
            sizes[level] = max(size, sizes.get(level, 0))
    except (OSError, ValueError):
        return None
    return sizes[max(sizes)] if sizes else None


def stream_bucket_bytes(cache_bytes: int | None) -> int:
    """The largest power of two with STREAM_NUM_BUFFERS buckets in half of `cache_bytes`, within
    [MIN_STREAM_BUCKET_BYTES, MAX_STREAM_BUCKET_BYTES]; the maximum where the cache is unknown."""
    if cache_bytes is None:
        return MAX_STREAM_BUCKET_BYTES
    fit = cache_bytes // (2 * STREAM_NUM_BUFFERS)
    bucket = MIN_STREAM_BUCKET_BYTES
    while bucket * 2 <= min(fit, MAX_STREAM_BUCKET_BYTES):
        bucket *= 2
    return bucket


STREAM_BUCKET_BYTES = stream_bucket_bytes(last_level_cache_bytes())
_HEADER = struct.Struct("<Q")  # the length of each pickled message
_TOKEN_BYTES = 16


class StreamAddress(NamedTuple):
    """What the receiver needs to connect: the socket's name and the token it must present."""

    name: str
    token: bytes


class StreamReport(NamedTuple):
    """The receiver's account of one streamed sync."""

    num_buckets: int
    nbytes: int
    verify_s: float
    load_s: float


def _send(sock: socket.socket, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    view = memoryview(bytearray(n))
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return view.tobytes()


def _recv(sock: socket.socket):
    (n,) = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
    return pickle.loads(_recv_exactly(sock, n))


class BucketStream:
    """The sender's side: a listening socket (kept across syncs) and, during a sync, one
    connection per receiver. Use: `address` goes to every receiver's `receive_stream`;
    `accept(n, timeout_s)`; `ColocatedSender(stream.deliver, ...)`; `finish()` at the end of
    the sync (`abort()` if it failed)."""

    def __init__(self):
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        name = f"weight_sync-{secrets.token_hex(8)}"
        self._listener.bind("\0" + name)
        self._listener.listen(64)
        self.address = StreamAddress(name, secrets.token_bytes(_TOKEN_BYTES))
        self._peers: list[socket.socket] = []
        self.timeout_s = 0.0

    def accept(self, count: int, timeout_s: float, check: Callable[[], None] | None = None) -> None:
        """Wait (at most `timeout_s` in all) for `count` receivers to connect with the token.
        `check`, called about once a second while waiting, may raise to stop the wait (a
        receiver's start call that failed before it connected)."""
        self.abort()
        self.timeout_s = timeout_s
        deadline = time.monotonic() + timeout_s
        while len(self._peers) < count:
            left = deadline - time.monotonic()
            self._listener.settimeout(max(1e-3, min(left, 1.0)))
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                if check is not None:
                    try:
                        check()
                    except BaseException:
                        self.abort()
                        raise
                if time.monotonic() < deadline:
                    continue
                connected = len(self._peers)
                self.abort()
                raise WeightSyncError(
                    f"weight stream: {connected} of {count} receivers connected within "
                    f"{timeout_s:.0f} s (a receiver died or was never started)"
                ) from None
            conn.settimeout(max(1e-3, deadline - time.monotonic()))
            try:
                token = _recv_exactly(conn, _TOKEN_BYTES)
            except (EOFError, OSError):
                token = b""
            if not secrets.compare_digest(token, self.address.token):
                conn.close()  # not one of ours (or gone before it said who it is)
                continue
            conn.settimeout(timeout_s)
            self._peers.append(conn)

    @property
    def connected(self) -> int:
        """Receivers connected in this sync so far (readable from another thread while
        `accept` waits)."""
        return len(self._peers)

    def deliver(self, handle, manifest) -> _StreamAcks:
        """Hand one bucket to every connected receiver; the returned future's `result()` is the
        first receiver's ack once all have acknowledged it (in delivery order)."""
        for i, peer in enumerate(self._peers):
            try:
                _send(peer, ("bucket", handle, manifest))
            except OSError as e:
                raise self._refusal(i) or self._lost(i, e) from None
        return _StreamAcks(self)

    def next_ack(self) -> LoadAck:
        acks = []
        for i, peer in enumerate(self._peers):
            try:
                kind, value = _recv(peer)
            except TimeoutError:
                raise WeightSyncError(
                    f"weight stream: receiver {i} acknowledged no bucket within "
                    f"{self.timeout_s:.0f} s (hung, or too slow for the sync's timeout)"
                ) from None
            except (EOFError, OSError) as e:
                raise self._lost(i, e) from None
            if kind == "error":
                raise WeightSyncError(f"weight stream: receiver {i} refused a bucket: {value}")
            acks.append(value)
        return acks[0]

    def _refusal(self, i: int) -> WeightSyncError | None:
        """The error receiver i answered an earlier bucket with, if it did before closing (its
        unread acks come first)."""
        peer = self._peers[i]
        peer.settimeout(1.0)
        try:
            while True:
                kind, value = _recv(peer)
                if kind == "error":
                    return WeightSyncError(f"weight stream: receiver {i} refused a bucket: {value}")
        except (EOFError, OSError):
            return None
        finally:
            peer.settimeout(self.timeout_s)

    def _lost(self, i: int, error: BaseException) -> WeightSyncError:
        return WeightSyncError(
            f"weight stream: receiver {i} closed its connection ({type(error).__name__}); "
            "its process died or gave up"
        )

    def finish(self) -> None:
        """End the sync: every receiver's `receive_stream` returns."""
        try:
            for i, peer in enumerate(self._peers):
                try:
                    _send(peer, ("end", None))
                except OSError as e:
                    raise self._refusal(i) or self._lost(i, e) from None
        finally:
            self.abort()

    def abort(self) -> None:
        """Drop the connections without the end message: receivers fail the sync."""
        for peer in self._peers:
            peer.close()
        self._peers = []

    def close(self) -> None:
        self.abort()
        self._listener.close()


class _StreamAcks:
    """A delivered bucket's acknowledgement; acks arrive in delivery order, and
    `ColocatedSender` collects them in that order."""

    def __init__(self, stream: BucketStream):
        self.stream = stream

    def result(self) -> LoadAck:
        return self.stream.next_ack()


def receive_stream(
    address: StreamAddress, receiver: BucketReceiver, timeout_s: float
) -> StreamReport:
    """The receiver's side of one sync: connect, then verify and load each bucket as it comes
    (`receiver.load`), acknowledging each, until the sender's end message. A bucket refused
    (checksum mismatch, a load error) is answered with the error and raised here; no message
    within `timeout_s`, or the sender gone, raises `WeightSyncError`."""
    name, token = address
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    buckets = nbytes = 0
    verify_s = load_s = 0.0
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect("\0" + name)
        except OSError as e:
            raise WeightSyncError(
                f"weight stream: cannot reach the sender's socket ({e}); it is on another "
                "host, or gone"
            ) from None
        sock.sendall(token)
        while True:
            try:
                kind, *message = _recv(sock)
            except TimeoutError:
                raise WeightSyncError(
                    f"weight stream: no bucket from the sender within {timeout_s:.0f} s after "
                    f"{buckets} bucket(s) (sender hung); the update is not complete"
                ) from None
            except (EOFError, OSError):
                raise _sender_gone(buckets) from None
            if kind == "end":
                return StreamReport(buckets, nbytes, verify_s, load_s)
            try:
                ack = receiver.load(*message)
            except Exception as e:
                try:
                    _send(sock, ("error", f"{type(e).__name__}: {e}"))
                except OSError:
                    pass  # the sender is gone too: the error below is the one that matters
                raise
            buckets += 1
            try:
                _send(sock, ("ack", ack))
            except OSError:
                raise _sender_gone(buckets) from None
            nbytes += ack.nbytes
            verify_s += ack.verify_s
            load_s += ack.load_s
    finally:
        sock.close()


def _sender_gone(buckets: int) -> WeightSyncError:
    return WeightSyncError(
        f"weight stream: the sender closed the stream after {buckets} bucket(s), before its "
        "end (it died or failed); the update is not complete"
    )
