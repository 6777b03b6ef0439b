"""Worker processes a section drives over pipes, without Ray: an engine and a trainer sharing
one GPU, each in its own spawned process (its own CUDA context, as under Ray).

`Peer(factory, *args)` spawns a process that builds `factory(*args)` and then serves method
calls; `peer.call(name, *args)` returns the result or raises `PeerError` carrying the worker's
traceback. No wait is unbounded: every receive polls with a timeout and notices a worker that
died (the parent closes its copy of the worker's pipe end, so a dead worker reads as EOF instead
of a silent hang). `link()` gives two workers a pipe of their own (the weight sync's handles go
straight from trainer to engine).
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import traceback
from multiprocessing.connection import Connection
from typing import Any

DEFAULT_TIMEOUT_S = 240.0


class PeerError(RuntimeError):
    """A worker raised, died or did not answer in time; the message holds its traceback."""


def recv(conn: Connection, timeout_s: float, who: str, process=None) -> Any:
    """conn.recv() within `timeout_s`; raises PeerError on timeout, EOF or a dead `process`."""
    waited = 0.0
    step = 0.25
    while not conn.poll(step):
        waited += step
        if process is not None and not process.is_alive():
            raise PeerError(f"{who} exited with code {process.exitcode} without answering")
        if waited >= timeout_s:
            raise PeerError(f"{who} did not answer within {timeout_s:.0f} s")
    try:
        return conn.recv()
    except EOFError:
        raise PeerError(f"{who} closed its pipe (it exited)") from None


def _serve(factory: str, args: tuple, conn: Connection) -> None:
    try:
        module, _, name = factory.partition(":")
        obj = getattr(importlib.import_module(module), name)(*args)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message is None:
            return
        method, call_args = message
        try:
            reply = ("ok", getattr(obj, method)(*call_args))
        except BaseException:  # noqa: BLE001 - reported to the parent
            reply = ("error", traceback.format_exc())
        conn.send(reply)


class Peer:
    def __init__(self, factory: str, *args, name: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.name = name
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(factory, args, child), name=name)
        self.process.start()
        child.close()  # ours: else a dead worker's end stays open here and recv never sees EOF
        self._pending: str | None = "start"

    def _reply(self, timeout_s: float | None) -> Any:
        what, self._pending = self._pending, None
        status, value = recv(
            self.conn, timeout_s or self.timeout_s, f"{self.name} ({what})", self.process
        )
        if status == "error":
            raise PeerError(f"{self.name} failed in {what}:\n{value}")
        return value

    def ready(self, timeout_s: float | None = None) -> None:
        """Wait until the worker is built (construction errors surface here)."""
        if self._pending == "start":
            self._reply(timeout_s)

    def submit(self, method: str, *args) -> None:
        """Start a call; `result()` waits for it (one call in flight per worker)."""
        self.ready()
        if self._pending is not None:
            raise RuntimeError(f"{self.name}: {self._pending} still in flight")
        self.conn.send((method, args))
        self._pending = method

    def result(self, timeout_s: float | None = None) -> Any:
        return self._reply(timeout_s)

    def call(self, method: str, *args, timeout_s: float | None = None) -> Any:
        self.submit(method, *args)
        return self.result(timeout_s)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def link() -> tuple[Connection, Connection]:
    """A pipe for two workers: pass one end to each factory, then close both here (`unlink`)."""
    return mp.get_context("spawn").Pipe()


def unlink(ends: tuple[Connection, Connection]) -> None:
    for end in ends:
        end.close()


class PipeFuture:
    """The sender side of a delivery over a worker-to-worker pipe (`ColocatedSender`'s
    `deliver` returns one): `result()` is the receiver's acknowledgement."""

    def __init__(self, conn: Connection, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.conn = conn
        self.timeout_s = timeout_s

    def result(self):
        status, value = recv(self.conn, self.timeout_s, "the receiving engine")
        if status == "error":
            raise PeerError(f"the receiving engine failed:\n{value}")
        return value
