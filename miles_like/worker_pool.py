"""A pool of worker processes for user code, every call bounded in time: what runs the reward
functions (`scoring/reward_pool.py`) and the tools (`rollouts/tool_pool.py`).

User code may hang, end its process (`os._exit`, a segfault in a C extension), raise, or produce
far more output than anyone should read. None of that may stall or kill the controller, so each
call runs in a worker process:

* a call that outlives `timeout_s` has its worker killed and replaced: the caller gets `timeout`
  at its deadline, the replacement starts in the background;
* a worker that dies during a call is that call's `crashed` (with its exit code) and is
  replaced; one found dead while idle (killed from outside, or its pipe shut by the user code)
  is replaced before it takes a job, at no call's expense;
* an exception is the call's `raised` (with its message); the worker lives on;
* only the handler's reply crosses back, and the handlers keep it small (a checked float, a
  capped text): an oversized output never leaves its worker.

Workers are spawned (a fresh interpreter, not a fork of a controller holding Ray and torch
threads), daemonic, and live across calls. Each runs `setup(*setup_args)` once (import the user
code; anything it raises is reported to the controller, which raises it there) and then
`handler(job)` per call. `setup` must be a module-level function and its arguments picklable;
user code travels by name and is imported in the worker, so it must be importable from the
controller's `sys.path` (spawn passes it on). A worker exits as soon as the controller dies,
even inside a call that never returns (`run/orphans.py`).

Calls are blocking and thread-safe: each takes an idle worker, so at most `size` run at once
and `map` runs a batch on all of them.

Why not pebble's `ProcessPool`, which has per-task timeouts and crash detection: its workers
share one task channel, so an idle worker killed from outside breaks the whole pool ("All
workers expired") where ours replaces it, and it hands successive calls to the same worker
rather than taking turns, which the tool tests rely on to see every worker.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Literal, NamedTuple

from miles_like.run.orphans import exit_with_parent

# A spawned worker imports the user's modules (math-verify pulls in sympy); far more than this
# means the import itself hangs.
STARTUP_TIMEOUT_S = 120.0
MAX_ERROR_CHARS = 300  # an exception's message as the caller gets it
# how long a worker that closed its pipe may take to finish exiting before it is killed (its
# own exit code is the better report)
EXIT_GRACE_S = 1.0

Status = Literal["ok", "raised", "timeout", "crashed", "unavailable"]


class Outcome(NamedTuple):
    status: Status
    reply: Any = None  # ok: the handler's reply; raised: "ExceptionType: message"
    exitcode: int | None = None  # crashed: the worker's exit code


def _worker_main(
    conn: Connection, setup: Callable[..., Callable[[Any], Any]], setup_args: tuple, quiet: bool
) -> None:
    """A worker process: run `setup`, say ready, then answer jobs until the pipe closes."""
    exit_with_parent()  # a call that never returns must not outlive the controller
    if quiet:  # the user code's prints would interleave with the controller's output
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    try:
        handler = setup(*setup_args)
    except BaseException as e:  # noqa: BLE001 (reported to the controller, raised there)
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):  # the pool closed its end, or the controller died
            return
        try:
            message = ("ok", handler(job))
        except BaseException as e:  # noqa: BLE001 (SystemExit too: the worker lives on)
            message = ("raised", f"{type(e).__name__}: {e}"[:MAX_ERROR_CHARS])
        conn.send(message)


class _Worker(NamedTuple):
    process: multiprocessing.process.BaseProcess
    conn: Connection  # the pool's end of the pipe


def _stop(worker: _Worker, grace_s: float = 0.0) -> None:
    # Our child is reaped by no one else, so its pid cannot have been reused: the signal
    # reaches the worker or (already dead) nothing.
    worker.conn.close()
    worker.process.join(timeout=grace_s)
    if worker.process.is_alive():
        worker.process.kill()
    worker.process.join(timeout=10)


def hung_up(conn: Connection) -> bool:
    """Whether an idle worker's pipe (the pool's end, `conn`) can no longer carry a job. An idle
    worker never writes, so anything readable is the end of it: a killed worker's pipe closes as
    it exits, before `waitpid` can reap it (a multi-threaded process stays unreapable until its
    last thread is released), and user code may shut the pipe and live on. A pipe closed here
    (the pool is closing) counts too."""
    try:
        return conn.poll(0)
    except OSError:
        return True


def _stop_all(workers: set[_Worker]) -> None:
    for w in list(workers):
        _stop(w)
    workers.clear()


_EXITING = threading.Event()
# Set when the interpreter starts exiting, before it joins the threads still running (a rollout
# thread starting the reward pool, say): such a thread must not wait STARTUP_TIMEOUT_S for a
# worker still importing, the exit would wait with it. `atexit` runs after that join, so this
# uses the hook concurrent.futures registers its own exit with; registered after it (this module
# imports it first), it runs before it.
if hasattr(threading, "_register_atexit"):
    threading._register_atexit(_EXITING.set)


def _exiting() -> bool:
    return _EXITING.is_set()


class WorkerPool:
    """`size` spawned workers running `setup(*setup_args)`'s handler, `timeout_s` per call.
    `what` names the user code in errors (e.g. "reward.function='m:f'"), `name` the worker
    processes. `quiet`: the user code's stdout / stderr go to /dev/null. The constructor
    returns once every worker is ready and raises RuntimeError, with the worker's reason, if
    one cannot start."""

    def __init__(
        self,
        setup: Callable[..., Callable[[Any], Any]],
        setup_args: tuple = (),
        *,
        size: int,
        timeout_s: float,
        what: str,
        name: str = "worker",
        quiet: bool = False,
    ):
        if size < 1 or timeout_s <= 0:
            raise ValueError(f"{what}: {size} workers, timeout {timeout_s} s; use >= 1 and > 0")
        if _exiting():  # a rollout thread asking for a pool after the run stopped
            raise RuntimeError(f"{what}: no workers started, the process is exiting")
        self.size, self.timeout_s, self.what, self.name = size, timeout_s, what, name
        self._start_args = (setup, setup_args, quiet)
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._all)
        started = [self._start() for _ in range(size)]
        try:
            for w in started:
                self._await_ready(w)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------------------ processes
    def _start(self) -> _Worker:
        ours, theirs = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(theirs, *self._start_args), daemon=True, name=self.name
        )
        process.start()
        theirs.close()  # the worker holds the other end: its exit is EOF here
        worker = _Worker(process, ours)
        with self._lock:
            self._all.add(worker)
        return worker

    def _await_ready(self, worker: _Worker) -> None:
        """Wait for a started worker's hello and make it available; RuntimeError if it reports
        a failure, dies, or stays silent past STARTUP_TIMEOUT_S."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        hello = None
        try:
            while not _exiting() and time.monotonic() < deadline:
                if worker.conn.poll(0.2):
                    hello = worker.conn.recv()
                    break
        except (EOFError, OSError):
            hello = ("died", None)
        if hello is None or hello[0] != "ready":
            self._discard(worker)
            if hello is None and _exiting():
                reason = "was still starting when the process exited"
            elif hello is None:
                reason = f"did not start within {STARTUP_TIMEOUT_S:.0f} s"
            elif hello[0] == "failed":
                reason = f"could not load it: {hello[1]}"
            else:
                reason = f"died while starting (exit code {worker.process.exitcode})"
            raise RuntimeError(f"{self.what}: a worker process {reason}")
        self._idle.put(worker)

    def _discard(self, worker: _Worker, grace_s: float = 0.0) -> None:
        with self._lock:
            self._all.discard(worker)
        _stop(worker, grace_s)

    def _replace(self, worker: _Worker, grace_s: float = 0.0) -> None:
        """Stop `worker` and start its replacement in the background: the call that found it
        dead or hung returns at once."""
        self._discard(worker, grace_s)
        if self._closed:
            return

        def restart():
            try:
                self._await_ready(self._start())
            except RuntimeError:
                pass  # callers waiting for a worker get "unavailable" after their wait

        threading.Thread(target=restart, name=f"{self.name}-restart", daemon=True).start()

    def _take(self) -> _Worker | None:
        """An idle, live worker; None if none comes within a call's timeout plus a start, or
        the pool is closed."""
        while not self._closed:
            try:
                worker = self._idle.get(timeout=self.timeout_s + STARTUP_TIMEOUT_S)
            except queue.Empty:
                return None
            if worker.process.is_alive() and not hung_up(worker.conn):
                return worker
            self._replace(worker)  # killed (or hung up) while idle: costs no call
        return None

    def pids(self) -> list[int]:
        """The workers' process ids (started or running), for checks from outside."""
        with self._lock:
            return [w.process.pid for w in self._all]

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers = set(self._all)
            self._all.clear()
        _stop_all(workers)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------------------------- calls
    def call(self, job: Any) -> Outcome:
        """Run the handler on `job` in a worker; never raises, never blocks much past
        `timeout_s` (plus a worker's start when every worker was just replaced)."""
        if self._closed:
            return Outcome("unavailable")
        worker = self._take()
        if worker is None:
            return Outcome("unavailable")
        try:
            worker.conn.send(job)
            if not worker.conn.poll(self.timeout_s):
                self._replace(worker)
                return Outcome("timeout")
            status, reply = worker.conn.recv()
        except (EOFError, OSError):  # the worker died in the call (or as it was sent)
            self._replace(worker, EXIT_GRACE_S)
            return Outcome("crashed", exitcode=worker.process.exitcode)
        self._idle.put(worker)
        return Outcome(status, reply)

    def map(self, jobs: Sequence[Any]) -> list[Outcome]:
        """`call` on every job, on all workers at once; outcomes in the jobs' order."""
        if not jobs:
            return []
        threads = ThreadPoolExecutor(min(self.size, len(jobs)), thread_name_prefix=self.name)
        try:
            return list(threads.map(self.call, jobs))
        except BaseException:  # Ctrl-C, SystemExit(143): end the calls now, not at their timeout
            self.close()
            raise
        finally:
            threads.shutdown()
