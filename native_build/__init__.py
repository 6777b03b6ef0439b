"""Native C kernels: built on first use with the system C compiler, cached, loaded with ctypes.

A source is compiled once per (source text, flags, compiler version, this CPU) into a cache
directory, then loaded with `ctypes.CDLL`. ctypes releases the GIL during a call. Nothing is
downloaded; without a compiler (or with MILES_LIKE_NATIVE=0) `load` raises `Unavailable` and each
caller falls back to its torch path.

Loading a library runs its code, so the cache directory must be private: a directory owned by
this user with mode 0700 (created so; `MILES_LIKE_NATIVE_CACHE`, else ~/.cache/miles_like/native,
else a per-user directory under the system temp dir). A directory that exists with another owner
or other permissions is refused: in a shared place such as /tmp another user could have created
it and planted a library under the name we would load.

A leaf package: it imports nothing of ours, so both `rollout` and `weight_sync` may use it.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path


class Unavailable(RuntimeError):
    """The kernel cannot be built or loaded here; the message says why."""


class UnsafeCacheDir(Unavailable):
    """The cache directory is not private to this user: nothing in it may be loaded."""


def cache_dir() -> Path:
    root = os.environ.get("MILES_LIKE_NATIVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "miles_like", "native"
    )
    return Path(root)


def cpu_id() -> str:
    """-march=native code only runs where it was built: key the cache by the CPU's model and
    flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [
                line
                for line in f
                if line.startswith(("model name", "flags", "Features", "CPU part"))
            ]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def compiler() -> str | None:
    return (
        os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    )


def private_dir(path: Path) -> Path:
    """`path`, created with mode 0700 if missing; raises UnsafeCacheDir unless it is a real
    directory (not a symlink) owned by this user that no one else can write. One of ours that is
    merely readable by others (an older cache, 0755) is tightened to 0700: no one else can have
    written into it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or mode & 0o022:
        raise UnsafeCacheDir(
            f"{path} is not a directory owned by uid {os.getuid()} with mode 0700 "
            f"(owner {st.st_uid}, mode {mode:o}); remove it, or point "
            "MILES_LIKE_NATIVE_CACHE at a private directory"
        )
    if mode != 0o700:
        os.chmod(path, 0o700)
    return path


def headers_of(source: Path) -> list[Path]:
    """The headers `source` includes with quotes (`#include "x.h"`), beside it."""
    names = re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(), flags=re.MULTILINE)
    return [source.with_name(n) for n in names]


def library_name(source: Path, flags: list[str], cc: str) -> str:
    """The cached library's file name: `<stem>-<key>.so`, keyed by the source and the headers
    it includes, the flags, the compiler and this CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    texts = [source.read_text(), *(h.read_text() for h in headers_of(source))]
    key = hashlib.sha256(
        "\0".join([*texts, " ".join(flags), version, cpu_id(), platform.machine()]).encode()
    ).hexdigest()[:20]
    return f"{source.stem}-{key}.so"


def build(source: Path, flags: list[str], cc: str) -> Path:
    """The library of `source` in the private cache, compiled there unless already present."""
    name = library_name(source, flags, cc)
    try:
        directory = private_dir(cache_dir())
    except OSError:  # read-only home: a per-user directory under the system temp dir
        directory = private_dir(Path(tempfile.gettempdir()) / f"miles_like_native_{os.getuid()}")
    target = directory / name
    if target.exists():
        return target
    # Build beside the target and rename: concurrent first users race safely.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise Unavailable(f"{cc} failed: {result.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load(source: Path, flags: list[str]) -> ctypes.CDLL:
    """Build (once) and load `source`; raises Unavailable saying why it cannot be."""
    if os.environ.get("MILES_LIKE_NATIVE", "1") == "0":
        raise Unavailable("disabled by MILES_LIKE_NATIVE=0")
    if sys.byteorder != "little":
        raise Unavailable("big-endian host")
    cc = compiler()
    if cc is None:
        raise Unavailable("no C compiler (cc, gcc or clang) on PATH; install one to enable it")
    try:
        return ctypes.CDLL(str(build(source, flags, cc)))
    except UnsafeCacheDir as e:
        raise Unavailable(f"refusing to load native code from a shared place: {e}") from e
    except Unavailable:
        raise
    except Exception as e:  # noqa: BLE001 -- any build/load failure means: fall back
        raise Unavailable(f"building {source.name} failed: {e}") from e


class LazyLibrary:
    """One C source, built and loaded at the first call (then declared by `declare`); None, with
    one warning saying `fallback`, where that is impossible (none at all with
    MILES_LIKE_NATIVE=0, which asks for the fallback)."""

    def __init__(
        self,
        source: Path,
        flags: list[str],
        declare: Callable[[ctypes.CDLL], ctypes.CDLL],
        what: str,
        fallback: str,
    ):
        self.source, self.flags, self.declare = source, flags, declare
        self.what, self.fallback = what, fallback
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._tried = False

    def __call__(self) -> ctypes.CDLL | None:
        if self._tried:
            return self._lib
        with self._lock:
            if not self._tried:
                try:
                    self._lib = self.declare(load(self.source, self.flags))
                except Unavailable as e:
                    if os.environ.get("MILES_LIKE_NATIVE", "1") != "0":
                        warnings.warn(
                            f"{self.what} unavailable ({e}); {self.fallback}",
                            RuntimeWarning,
                            stacklevel=2,
                        )
                self._tried = True
        return self._lib

    def build(self, flags: list[str]) -> ctypes.CDLL:
        """The same source built with other flags (tests: the portable build)."""
        return self.declare(load(self.source, flags))
