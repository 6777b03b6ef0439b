"""Sections for the harness tests (tests/gpu_suite/test_gpu_suite_harness.py): each behaves
as a broken GPU section can (fails a check, raises, dies, hangs with a child of its own), so the
tests see the real harness report it and go on. Imported by name in the section processes (the
tests put this folder on their PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def passes(ctx) -> dict:
    ctx.check("agrees", True, max_err=0.0)
    return {"figure": 42, "dry_run": ctx.dry_run, "device": ctx.device}


def fails_check(ctx) -> dict:
    ctx.check("agrees", True)
    ctx.check("exact", False, max_err=0.5, bound=1e-4)
    return {"figure": 1}


def raises(ctx) -> dict:
    ctx.check("before", True)
    raise ValueError("boom in a section")


def crashes(ctx) -> dict:
    ctx.check("before_crash", True)
    sys.stdout.flush()
    os.abort()  # SIGABRT: no Python exception, no result file; faulthandler prints the stack


def hangs(ctx) -> dict:
    """Starts a child of its own (as an engine process would), records its pid, then never
    returns: the harness must kill both at the budget."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    ctx.note(grandchild_pid=child.pid)
    ctx.check("before_hang", True)
    while True:
        time.sleep(0.1)


def imports_probe(ctx) -> dict:
    import gpu_suite_probe  # from a carried wheel

    return {"probe": gpu_suite_probe.VALUE}
