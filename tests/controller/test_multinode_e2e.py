"""Two Ray nodes on one machine, for real: two network namespaces joined by a veth pair, each
with its own private address, `ray start --head` in one and `ray start --address` in the other.
The RL loop then runs with trainer ranks and engines on both nodes, colocated and disaggregated:
every rendezvous (the trainer world, the broadcast group) must be reachable from the other node,
and colocated weight sync must reach an engine on another node (shared memory does not cross
machines: the second node has a /dev/shm of its own). Checks: the run completes, actors really
ran on both nodes, the float64 engine-vs-trainer log-prob gap stays at rounding level, and the
remote engine's weights are bitwise the trainer's final weights (its checkpoint).

The namespaces, the link and both Ray nodes are created and removed by the fixture. Traffic stays
inside the namespaces (10.213.7.0/24 exists only there).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
HEAD, WORKER = "10.213.7.1", "10.213.7.2"
NS = {"mlt_head": HEAD, "mlt_worker": WORKER}
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("ip") is None,
        reason="needs root and iproute2 to create network namespaces",
    ),
]


def sh(*cmd: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout[-2000:]}"
            f"\n{proc.stderr[-2000:]}"
        )
    return proc


# Both nodes and the driver share one token (Ray's token authentication): this cluster's own.
RAY_AUTH = ("RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN={secrets.token_hex(32)}")


def in_ns(ns: str, *cmd: str, **kw) -> subprocess.CompletedProcess:
    return sh("ip", "netns", "exec", ns, "env", *RAY_AUTH, *cmd, **kw)


def _remove_namespaces() -> None:
    for ns in NS:
        if sh("ip", "netns", "pids", ns, check=False).returncode != 0:
            continue  # no such namespace
        for _ in range(50):  # until empty: a process may fork while its parent is being killed
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            if not pids:
                break
            sh("kill", "-9", *pids, check=False)
            time.sleep(0.1)
        sh("ip", "netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def two_nodes():
    _remove_namespaces()  # leftovers of an interrupted run
    temp_dir = tempfile.mkdtemp(prefix="mlt", dir="/tmp")  # Unix socket paths must stay short
    try:
        for ns in NS:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", "mlt_veth0", "type", "veth", "peer", "name", "mlt_veth1")
        for ns, dev in zip(NS, ("mlt_veth0", "mlt_veth1")):
            sh("ip", "link", "set", dev, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{NS[ns]}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "link", "set", dev, "up")
        common = ("--num-cpus", "2", "--disable-usage-stats")
        in_ns(
            "mlt_head",
            str(BIN / "ray"),
            "start",
            "--head",
            "--node-ip-address",
            HEAD,
            "--port",
            "6390",
            "--include-dashboard",
            "false",
            "--temp-dir",
            temp_dir,
            *common,
        )
        # The second node also gets a /dev/shm of its own (a private mount namespace), as a
        # second machine would: a shared-memory handle from the head node cannot open there.
        in_ns(
            "mlt_worker",
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "sh",
            "-c",
            'mount -t tmpfs -o size=4g tmpfs /dev/shm && exec "$@"',
            "sh",
            str(BIN / "ray"),
            "start",
            "--address",
            f"{HEAD}:6390",
            "--node-ip-address",
            WORKER,
            *common,
        )
        yield f"{HEAD}:6390"
    finally:
        # Not `ray stop`: it finds Ray processes by name on the whole machine, the network
        # namespace notwithstanding, and would stop every other Ray running here too. The
        # namespaces' own processes are exactly these nodes'.
        _remove_namespaces()
        shutil.rmtree(temp_dir, ignore_errors=True)


def _train(address: str, out: Path, *overrides: str) -> dict:
    report = out / "nodes.json"
    out.mkdir(parents=True)
    proc = in_ns(
        "mlt_head",
        f"PYTHONPATH={ROOT}",
        sys.executable,
        str(ROOT / "tests/controller/multinode_driver.py"),
        str(ROOT / "recipes/tiny_arith_grpo.yaml"),
        str(report),
        f"tracking.output_dir={out}",
        f"cluster.address={address}",
        "steps=3",
        "rollout.prompts_per_step=4",
        "rollout.n=4",
        "sft.steps=20",
        "sft.batch_size=16",
        "rollout.kv_cache_tokens=2048",
        "trainer.updates_per_rollout=1",
        "checkpoint.every_steps=3",
        "cluster.placement_strategy=SPREAD",
        *overrides,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:  # float64: engine and trainer agree to rounding on every step
        assert r["train/logprob_diff_max"] <= 1e-10
        assert r["perf/weight_sync_bytes"] > 0
    return json.loads(report.read_text())


def _assert_engines_hold_the_checkpoint(report: dict, out: Path, remote: list[int]) -> None:
    """The engines' weights after the last sync == the trainer's final weights, bitwise."""
    final = load_file(str(out / "checkpoints" / "step_000003" / "model.safetensors"))
    want = {
        name: hashlib.sha256(
            t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, t in final.items()
    }
    assert remote, "no engine ran on the second node"
    for i in remote:
        got = report["engine_digests"][i]
        assert want.keys() <= got.keys()
        assert {n: got[n] for n in want} == want, f"engine {i} differs from the trainer"


def test_colocated_across_two_nodes(two_nodes, tmp_path):
    report = _train(two_nodes, tmp_path / "colocated", "cluster.devices=4")
    assert set(report["trainer_ips"]) == {HEAD, WORKER}
    assert report["engine_ips"] == report["trainer_ips"]  # colocated: same bundle, same node
    remote = [i for i, ip in enumerate(report["engine_ips"]) if ip != report["trainer_ips"][0]]
    _assert_engines_hold_the_checkpoint(report, tmp_path / "colocated", remote)


def test_disaggregated_across_two_nodes(two_nodes, tmp_path):
    report = _train(
        two_nodes, tmp_path / "disaggregated", "cluster.devices=4", "cluster.colocate=false"
    )
    assert set(report["trainer_ips"]) == {HEAD, WORKER}
    assert set(report["engine_ips"]) == {HEAD, WORKER}
    remote = [i for i, ip in enumerate(report["engine_ips"]) if ip != report["trainer_ips"][0]]
    _assert_engines_hold_the_checkpoint(report, tmp_path / "disaggregated", remote)
