"""A stand-in controller for tests/controller/test_orphans.py: starts a reward or tool worker
pool, makes its worker hang in a user function, prints the worker's pid, then waits to be
killed (`python orphan_parent.py reward|tool`)."""

from __future__ import annotations

import sys
import threading
import time

from miles_like.rollouts.tools import ToolPool, load_tools
from miles_like.scoring.reward_pool import RewardPool


def main(kind: str) -> None:
    if kind == "reward":
        pool = RewardPool("unruly_rewards:by_response", size=1, timeout_s=3600.0)
        call = lambda: pool.score(["p"], ["hang"], [""])  # noqa: E731
    else:
        pool = ToolPool(load_tools(["user_tools:hang"]), workers=1, timeout_s=3600.0)
        call = lambda: pool.call("hang", {})  # noqa: E731
    threading.Thread(target=call, daemon=True).start()
    time.sleep(1.0)  # the call has reached the worker (it hangs there)
    print(pool.pids()[0], flush=True)
    time.sleep(3600.0)


if __name__ == "__main__":
    main(sys.argv[1])
