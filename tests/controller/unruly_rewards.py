"""Reward functions that misbehave, for the reward pool tests and a run of the real loop
(imported by the worker processes as `unruly_rewards:NAME`)."""

from __future__ import annotations

import ctypes
import os
import time

HANG_S = 3600.0


def by_response(prompt: str, response: str, answer: str) -> object:
    """Misbehaves as the response says; otherwise scores its length."""
    if response == "hang":
        time.sleep(HANG_S)
    if response == "exit":
        os._exit(3)
    if response == "segfault":
        ctypes.string_at(0)
    if response == "raise":
        raise RuntimeError("boom")
    if response == "sys.exit":
        raise SystemExit(1)
    if response == "hang_up":
        _hang_up_after_reply()
    junk = {
        "nan": float("nan"),
        "inf": float("inf"),
        "none": None,
        "string": "1.0",
        "huge_value": 1e300,
        "huge_int": 10**400,
        "huge_output": "x" * (64 << 20),
        "huge_list": [1.0] * (8 << 20),
    }
    if response in junk:
        return junk[response]
    return float(len(response))


def _hang_up_after_reply() -> None:
    """Shut this worker's end of its pipe to the pool once the reply is sent, and keep the
    process alive (a non-daemon thread outlives the worker's loop): a worker the pool must not
    hand another job, though `waitpid` says it lives, as in the moment a killed worker lingers
    unreaped."""
    import gc
    import socket
    import threading
    from multiprocessing.connection import Connection

    (conn,) = [o for o in gc.get_objects() if isinstance(o, Connection)]
    # shutdown, not close: the worker's loop is blocked reading the socket, and a read in
    # progress keeps a closed descriptor's socket open
    end = socket.socket(fileno=os.dup(conn.fileno()))

    def hang_up() -> None:
        time.sleep(0.5)  # the reply has gone by then
        end.shutdown(socket.SHUT_RDWR)  # the pool reads end of file; the loop's read returns
        time.sleep(HANG_S)

    threading.Thread(target=hang_up).start()


def pid_after(prompt: str, response: str, answer: str) -> float:
    """The worker's pid, after `response` seconds."""
    time.sleep(float(response))
    return float(os.getpid())


def arith_or_misbehave(prompt: str, response: str, answer: str) -> float:
    """The arithmetic task's reward, except that a response starting with 1 hangs, one starting
    with 2 kills its worker and one starting with 3 returns NaN: a run must survive all three."""
    text = response.strip()
    if text.startswith("1"):
        time.sleep(HANG_S)
    if text.startswith("2"):
        os._exit(3)
    if text.startswith("3"):
        return float("nan")
    return 1.0 if text == answer.strip() else 0.0
