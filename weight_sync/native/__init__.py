"""The native wxh64 kernel (wxh64.c): copy + checksum in one pass, and checksum alone.

Compiled on first use with the system C compiler (`cc -O3 -march=native`) into a cache
directory keyed by the source, the flags, the compiler and this CPU, then loaded with ctypes.
ctypes releases the GIL during the call, so two threads can each run half of a large tensor.
Without a compiler (or with MILES_LIKE_NATIVE=0) `kernel()` returns None after one warning and
weight sync falls back to xxh3; nothing is downloaded.

Loading a library runs its code, so the cache directory must be private: a directory owned by
this user with mode 0700 (created so; `MILES_LIKE_NATIVE_CACHE`, else ~/.cache/miles_like/native,
else a per-user directory under the system temp dir). A directory that exists with another owner
or other permissions is refused (one warning, xxh3): in a shared place such as /tmp another user
could have created it and planted a library under the name we would load.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("wxh64.c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]

_lock = threading.Lock()
_kernel: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("MILES_LIKE_NATIVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "miles_like", "native"
    )
    return Path(root)


def _cpu_id() -> str:
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


def _compiler() -> str | None:
    return (
        os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    )


class UnsafeCacheDir(RuntimeError):
    """The cache directory is not private to this user: nothing in it may be loaded."""


def _private_dir(path: Path) -> Path:
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


def library_name(cc: str) -> str:
    """The cached library's file name: keyed by the source, the flags, the compiler and this CPU."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join(
            [SOURCE.read_text(), " ".join(FLAGS), version, _cpu_id(), platform.machine()]
        ).encode()
    ).hexdigest()[:20]
    return f"wxh64-{key}.so"


def _build(cc: str) -> Path:
    name = library_name(cc)
    try:
        directory = _private_dir(_cache_dir())
    except OSError:  # read-only home: a per-user directory under the system temp dir
        directory = _private_dir(Path(tempfile.gettempdir()) / f"miles_like_native_{os.getuid()}")
    target = directory / name
    if target.exists():
        return target
    # Build beside the target and rename: concurrent first users (sender and receiver) race safely.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        result = subprocess.run(
            [cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise RuntimeError(f"{cc} failed: {result.stderr.strip()[:2000]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.wxh64_sum.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint64]
    lib.wxh64_sum.restype = ctypes.c_uint64
    lib.wxh64_copy_sum.argtypes = [
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_uint64,
        ctypes.c_int,
    ]
    lib.wxh64_copy_sum.restype = ctypes.c_uint64
    lib.wxh64_has_avx2.restype = ctypes.c_int
    return lib


def kernel() -> ctypes.CDLL | None:
    """The loaded kernel, building it on first use; None (one warning) if that is impossible."""
    global _kernel, _tried
    if _tried:
        return _kernel
    with _lock:
        if _tried:
            return _kernel
        reason = None
        if os.environ.get("MILES_LIKE_NATIVE", "1") == "0":
            reason = "disabled by MILES_LIKE_NATIVE=0"
        elif sys.byteorder != "little":
            reason = "big-endian host"
        elif (cc := _compiler()) is None:
            reason = "no C compiler (cc, gcc or clang) on PATH; install one to enable it"
        else:
            try:
                _kernel = _load(_build(cc))
            except UnsafeCacheDir as e:
                reason = f"refusing to load native code from a shared place: {e}"
            except Exception as e:  # noqa: BLE001 -- any build/load failure means: fall back
                reason = f"building {SOURCE.name} failed: {e}"
        if reason is not None and os.environ.get("MILES_LIKE_NATIVE", "1") != "0":
            warnings.warn(
                f"weight_sync: native wxh64 kernel unavailable ({reason}); using xxh3 checksums "
                "and torch copies, about 1.5x slower syncs.",
                RuntimeWarning,
                stacklevel=2,
            )
        _tried = True
        return _kernel
