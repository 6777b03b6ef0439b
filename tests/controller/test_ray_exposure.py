"""The local Ray a run starts serves no dashboard UI, and the dashboard process Ray keeps for
its internal agents listens on 127.0.0.1 only (a reachable dashboard takes job submissions)."""

from __future__ import annotations

import psutil
import ray
import shared_ray

from miles_like.recipe.sections import ClusterSection
from miles_like.run.placement import plan, start_ray


def test_local_ray_dashboard_is_off_and_on_loopback():
    shared_ray.stop()  # the local Ray earlier modules left running
    assert not ray.is_initialized()
    try:
        start_ray(ClusterSection(), plan(ClusterSection()))
        assert ray._private.worker.global_worker.node.address_info["webui_url"] in ("", None)
        session = ray._private.worker.global_worker.node.get_session_dir_path()
        for cmd in _commands_mentioning(session):
            if any(a.endswith("dashboard/dashboard.py") for a in cmd):
                assert "--host=127.0.0.1" in cmd, cmd
    finally:
        ray.shutdown()


def _commands_mentioning(session: str) -> list[list[str]]:
    out = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if any(session in a for a in cmd) or any("dashboard.py" in a for a in cmd):
            out.append(cmd)
    return out
