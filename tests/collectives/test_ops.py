"""`collectives` on a real 2-process gloo world, against values computed by hand.

Each collective runs on the world, on a standalone group built from its own store whose ranks
are the world's in reverse (so a group rank is not the global rank: `src` must be the group's),
and on a group of one (the shortcut). Inputs are non-contiguous where the call allows it (the
helper makes the contiguous copy torch wants and writes the result back in place).

The world and the standalone group meet through files (`two_ranks`, a FileStore): no port is
picked ahead of the processes binding it, which another process could take in between.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from two_ranks import join_world, run_two_ranks

import collectives

pytestmark = pytest.mark.slow

DEADLINE_S = 300


def _standalone(rank: int, store_file: str) -> dist.ProcessGroup:
    """The two ranks in reverse order, from their own store (as weight_sync's `SyncGroup`; a
    gloo group takes any store)."""
    store = dist.FileStore(store_file, 2)
    return dist.ProcessGroupGloo(dist.PrefixStore("own", store), 1 - rank, 2, timedelta(seconds=60))


def _check_group(group, me: int) -> None:
    """`me`: this process's rank in `group` (of 2). all_to_all_single: groups of the world
    only (a standalone gloo group has no such call; the TP group using it is the world's)."""
    assert collectives.group_device(group) == torch.device("cpu")
    assert collectives.size(group) == 2

    # all_reduce: in place, also on a non-contiguous view (written back), and MAX
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) * (me + 1)
    t = x.t()  # non-contiguous
    out = collectives.all_reduce(t, group=group)
    assert out is t and torch.equal(t, (torch.arange(6.0).reshape(2, 3) * 3).t().double())
    m = torch.tensor([me, 10 - me])
    collectives.all_reduce(m, op=collectives.ReduceOp.MAX, group=group)
    assert m.tolist() == [1, 10]

    # all_gather: concatenated along any dim in group-rank order; scalars stacked
    local = torch.full((2, 3), float(me))
    parts = [torch.full((2, 3), float(r)) for r in range(2)]
    assert torch.equal(collectives.all_gather(local, group=group), torch.cat(parts, 0))
    assert torch.equal(collectives.all_gather(local, dim=1, group=group), torch.cat(parts, 1))
    assert torch.equal(collectives.all_gather(local, dim=-1, group=group), torch.cat(parts, -1))
    assert collectives.all_gather(torch.tensor(me), group=group).tolist() == [0, 1]

    # gather: all_gather's answer on group rank `dst` only (None elsewhere); any dim
    for dst in (0, 1):
        got = collectives.gather(local.t(), dst=dst, dim=1, group=group)
        if me == dst:
            assert torch.equal(got, torch.cat([q.t() for q in parts], 1))
        else:
            assert got is None

    # broadcast: `src` is a group rank
    b = torch.full((4,), float(me))
    collectives.broadcast(b, src=1, group=group)
    assert torch.equal(b, torch.ones(4))

    # objects
    assert collectives.all_gather_object({"r": me}, group) == [{"r": 0}, {"r": 1}]
    assert collectives.broadcast_object(f"from {me}", src=1, group=group) == "from 1"

    # all_to_all_single with uneven splits: rank r sends r + 1 rows to every rank
    if group is not None:
        return
    send = torch.full((2 * (me + 1), 2), float(me))
    recv = torch.empty(1 + 2, 2)
    collectives.all_to_all_single(recv, send, [1, 2], [me + 1, me + 1], group=group)
    assert torch.equal(recv, torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))


def _worker(rank: int, rendezvous: str, store_file: str) -> None:
    join_world(rank, rendezvous)
    try:
        _check_group(None, rank)
        _check_group(_standalone(rank, store_file), 1 - rank)
        # a group of one: no collective; a gather of one part is the part (a scalar: [1])
        alone = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=10))
        t = torch.arange(3.0)
        assert collectives.all_reduce(t, group=alone) is t
        assert collectives.all_gather(t, group=alone) is t
        assert collectives.all_gather(torch.tensor(5.0), group=alone).shape == (1,)
        assert collectives.gather(t, group=alone) is t
        assert collectives.broadcast_object("x", src=0, group=alone) == "x"
    finally:
        dist.destroy_process_group()


def test_collectives_on_gloo(tmp_path):
    run_two_ranks(_worker, (str(tmp_path / "own_store"),), tmp_path, DEADLINE_S)
