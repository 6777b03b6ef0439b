"""No process of a run outlives it.

`exit_with_parent()` runs in the reward and tool worker processes (spawned by the controller):
a daemon thread waits on the parent's sentinel (a pipe end the parent holds, which closes when
the parent dies however it dies, SIGKILL included) and ends the worker then. An idle worker
would see its pipe close anyway; this also ends one stuck in a user function that never
returns, which would otherwise live on, re-parented to init.

`terminate_gracefully()` makes SIGTERM in the controller raise `SystemExit(143)` in its main
thread, so the run's `finally` blocks and `atexit` hooks run (Ray actors released, worker
pools closed, the tracker finished) as on Ctrl-C, instead of the interpreter dying on the spot;
`reassert_sigterm()` after `ray.init` keeps it in place, and a SIGTERM that a blocking Ray
call turns into its own exit still ends the run with 143.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


def exit_with_parent() -> None:
    """In a process started by `multiprocessing`: exit (code 1) as soon as its parent dies."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not a multiprocessing child: nothing to watch
        return

    def watch() -> None:
        wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def _raise_exit(signum, frame) -> None:
    global _terminated
    _terminated = True
    raise SystemExit(SIGTERM_EXIT_CODE)


_graceful = False  # within `terminate_gracefully`
_terminated = False  # a SIGTERM arrived within it


def reassert_sigterm() -> None:
    """Install our SIGTERM handler again within `terminate_gracefully`: `ray.init` sets its
    own Python handler and then, connecting the driver, its C++ crash reporter's (which aborts
    the driver on SIGTERM, skipping every cleanup) beneath Python's."""
    if _graceful and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_exit)


@contextlib.contextmanager
def terminate_gracefully():
    """Within the block (main thread only), SIGTERM raises SystemExit(143), and the block
    exits with 143 whatever became of that exception: a SIGTERM landing in a blocking Ray call
    (`ray.wait`, `ray.get`) comes out of it as Ray's own SystemExit(1)."""
    global _graceful, _terminated
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    _graceful, _terminated = True, False
    try:
        yield
    except SystemExit as e:
        if _terminated and e.code != SIGTERM_EXIT_CODE:
            raise SystemExit(SIGTERM_EXIT_CODE) from e
        raise
    finally:
        _graceful = False
        signal.signal(signal.SIGTERM, previous)
