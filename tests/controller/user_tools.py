"""Tools for the tool-pool tests: well-behaved ones and every way a tool can misbehave."""

from __future__ import annotations

import ctypes
import os
import sys
import time
from typing import Literal


def add(a: int, b: int, scale: float = 1.0) -> str:
    """Add two integers.

    Then multiply by a scale.

    Args:
        a: the first addend
        b: the second addend, which
            may be negative
        scale: a factor applied to the sum

    Returns:
        The scaled sum, as text.
    """
    return str((a + b) * scale)


def pid() -> int:
    """The worker's process id."""
    return os.getpid()


def shout(
    word: str, style: Literal["upper", "title"] = "upper", tags: list[str] | None = None
) -> dict:
    """Return the word in a style (a non-string result is sent as JSON).

    Args:
        word: the word
        style: how to write it
        tags: labels returned with it
    """
    return {"word": word.upper() if style == "upper" else word.title(), "tags": tags or []}


def echo(**kwargs) -> str:
    return repr(sorted(kwargs.items()))


echo.schema = {
    "name": "echo",
    "description": "echo the arguments",
    "parameters": {
        "type": "object",
        "properties": {"text": {"type": "string"}},
        "required": ["text"],
    },
}


def hang(seconds: float = 3600.0) -> str:
    """Sleep far longer than any timeout.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "woke up"


def spin() -> str:
    """Burn CPU forever (ignores signals a sleep would get)."""
    while True:
        pass


def exit_hard(code: int = 3) -> str:
    """End the process without any cleanup.

    Args:
        code: its exit code
    """
    os._exit(code)


def segfault() -> str:
    """Dereference a null pointer."""
    return str(ctypes.string_at(0))


def flood(n: int) -> str:
    """Return n characters.

    Args:
        n: how many
    """
    return "x" * n


def chatty() -> str:
    """Print a lot, then answer."""
    for _ in range(1000):
        print("noise " * 100)
        print("more noise", file=sys.stderr)
    return "quiet answer"


def boom() -> str:
    """Raise."""
    raise ValueError("boom at the tool")


def leave() -> str:
    """Call sys.exit (a BaseException) from inside the tool."""
    sys.exit(5)


def untyped(x) -> str:
    """No annotation.

    Args:
        x: anything
    """
    return str(x)


def star(*args: int) -> str:
    """Positional arguments.

    Args:
        args: numbers
    """
    return str(args)


def undocumented(x: int) -> str:
    """An argument without a description."""
    return str(x)
