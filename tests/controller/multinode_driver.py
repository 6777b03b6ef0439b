"""Driver of the two-node test (`test_multinode_e2e.py`), run inside the head node's network
namespace: trains a recipe on an existing Ray cluster and, just before the run releases its
actors, records where every actor ran and the sha256 of every engine's weights.

    python multinode_driver.py RECIPE REPORT.json key=value ...
"""

from __future__ import annotations

import json
import sys


def _record_then_shutdown(report_path: str):
    import ray

    from miles_like.run.actors import RunActors
    from miles_like.run.calls import start_on_all, wait_all

    real_shutdown = RunActors.shutdown

    def shutdown(self, graceful: bool = True):
        ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
        trainers = wait_all(start_on_all("trainer rank", self.trainers, "node_id"), 60)
        engines = wait_all(start_on_all("engine", self.engines, "node_id"), 60)
        digests = wait_all(start_on_all("engine", self.engines, "weight_digests"), 60)
        with open(report_path, "w") as f:
            json.dump(
                {
                    "trainer_ips": [ips[n] for n in trainers],
                    "engine_ips": [ips[n] for n in engines],
                    "engine_digests": digests,
                },
                f,
            )
        real_shutdown(self, graceful)

    return shutdown


if __name__ == "__main__":
    # imported here: the run's spawned reward workers import this module again as their
    # __main__ (`miles_like/train.py` says why that must stay light)
    from miles_like.recipe.cli import main
    from miles_like.run.actors import RunActors
    from miles_like.run.loop import run

    recipe, report, *overrides = sys.argv[1:]
    RunActors.shutdown = _record_then_shutdown(report)
    sys.exit(main([recipe, *overrides], run=run))
