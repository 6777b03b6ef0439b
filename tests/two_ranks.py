"""Two spawned processes joined in a 2-rank gloo world: the ranks of the engine tensor-parallel
tests and of the collectives' tests.

`run_two_ranks(fn, args, out_dir, deadline_s)` starts `fn(rank, rendezvous, *args)` in two spawned
processes and waits for both (killing both, and failing the test, past `deadline_s`); each calls
`join_world(rank, rendezvous)` first. The world meets through a file in `out_dir` rather than a
port: a port picked free here and bound later by rank 0 can be taken in between by another test's
process under the parallel suite.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def join_world(rank: int, rendezvous: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)


def run_two_ranks(fn: Callable, args: tuple, out_dir: Path, deadline_s: float) -> None:
    rendezvous = Path(out_dir) / "rendezvous"
    assert not rendezvous.exists(), f"{rendezvous}: a file rendezvous must start absent"
    context = mp.start_processes(
        fn, args=(str(rendezvous), *args), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + deadline_s
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the two ranks did not finish within {deadline_s} s")
