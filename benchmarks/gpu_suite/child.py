"""One section in its own process: `python -m benchmarks.gpu_suite.child module:function`.

The harness passes the result file, work folder, dry-run flag and timeout in the environment
(`Context.from_env`). An exception is written with its full traceback; shortly before the
timeout, faulthandler prints every thread's stack to the log, so a hang shows where it hung.
"""

from __future__ import annotations

import faulthandler
import importlib
import sys
import traceback

from benchmarks.gpu_suite.context import Context

STACKS_BEFORE_TIMEOUT_S = 3.0


def main(target: str) -> int:
    ctx = Context.from_env()
    faulthandler.enable()
    if ctx.timeout_s > STACKS_BEFORE_TIMEOUT_S + 1:
        faulthandler.dump_traceback_later(ctx.timeout_s - STACKS_BEFORE_TIMEOUT_S, exit=False)
    try:
        module_name, _, function = target.partition(":")
        run = getattr(importlib.import_module(module_name), function or "run")
        ctx.finish(run(ctx))
    except BaseException as e:  # noqa: BLE001 - every failure is reported, with its traceback
        ctx.fail(f"{type(e).__name__}: {e}", traceback.format_exc())
        return 1
    finally:
        faulthandler.cancel_dump_traceback_later()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
