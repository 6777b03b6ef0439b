"""A weight-sync group fails after its timeout instead of hanging: joining when a member never
comes, and a broadcast a member never joins (gloo; NCCL takes the same timeout via its
options, untested without a GPU).

Rank 0's store listens on a port the OS picks when it binds (port 0), which the other member is
given: a port probed free and bound later can be taken by another process in between."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from weight_sync.group import SyncGroup


def test_join_without_the_other_member_times_out():
    start = time.monotonic()
    with pytest.raises(torch.distributed.DistStoreError, match="(?i)timed out"):
        SyncGroup.create("127.0.0.1", 0, rank=0, size=2, timeout_s=1.0)
    assert time.monotonic() - start < 30


def test_broadcast_a_member_never_joins_times_out():
    groups = {}
    # rank 0's store, listening before either member joins (as `rendezvous.held_rendezvous`)
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=1.0)
    )

    def join(rank):
        groups[rank] = SyncGroup.create(
            "127.0.0.1",
            store.port,
            rank=rank,
            size=2,
            timeout_s=1.0,
            master_store=store if rank == 0 else None,
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert set(groups) == {0, 1}
    # both members in place: a broadcast completes
    done = threading.Thread(target=groups[1].broadcast, args=(torch.zeros(3), 0))
    done.start()
    groups[0].broadcast(torch.ones(3), 0)
    done.join(timeout=60)
    # rank 1 stops taking part (a stuck engine): rank 0's next broadcast raises, no hang
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        groups[0].broadcast(torch.ones(1 << 20), 0)
    assert time.monotonic() - start < 30
