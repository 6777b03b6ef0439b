"""The rollouts' small parts, on their own: replica shares, the asynchronous producer's ledger
(where every drawn group is), and the channel through which the rollouts' loop asks the
controller's thread for an engine replacement."""

from __future__ import annotations

import asyncio
import threading

import pytest
from ray.exceptions import RayActorError

from miles_like.data import Problem
from miles_like.rollouts.async_producer.ledger import BufferedGroup, GroupInProgress, Ledger
from miles_like.rollouts.engine_deaths import RestartRequests, engine_death
from miles_like.rollouts.partial import OpenGroup
from miles_like.run.calls import ActorDied
from miles_like.shares import near_equal_shares, replica_of


@pytest.mark.parametrize("n", range(0, 12))
@pytest.mark.parametrize("parts", [1, 2, 3, 5])
def test_shares_are_contiguous_near_equal_and_larger_first(n, parts):
    shares = near_equal_shares(n, parts)
    assert [k for share in shares for k in share] == list(range(n))
    sizes = [len(s) for s in shares]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert all(replica_of(k, n, parts) == i for i, share in enumerate(shares) for k in share)


def _open(i: int) -> GroupInProgress:
    return GroupInProgress(i, OpenGroup(Problem(f"p{i}", [1, 2], "a"), ()))


def test_the_ledger_counts_every_drawn_group_once():
    loop = asyncio.new_event_loop()
    ledger = Ledger(capacity=9)
    ledger.open = {i: _open(i) for i in (7, 8)}
    ledger.buffered = [BufferedGroup(i, _open(i).group, loop.create_future(), 0) for i in (5, 2)]
    ledger.taken = [[0, 1, 3], [4]]
    ledger.filtered = [6]
    ledger.dropped, ledger.aborted = [11, 9], [10]
    # filtered and dropped groups hold no room; open, buffered and taken ones do
    assert ledger.room() == 9 - 2 - 2 - 4
    assert ledger.held() == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert ledger.report() == ([9, 11], [10], [0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert ledger.report() == ([], [], [0, 1, 2, 3, 4, 5, 6, 7, 8])  # reported once
    loop.close()


def test_a_buffered_groups_lag_is_counted_from_its_oldest_token():
    loop = asyncio.new_event_loop()
    done = loop.create_future()
    assert BufferedGroup(0, _open(0).group, done, 3).lag(5) == 2
    assert BufferedGroup(0, _open(0).group, done, None).lag(5) == 0  # no token: never stale
    loop.close()


def _on_loop_thread():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def test_restarts_asked_on_the_loop_are_made_on_the_waiting_thread():
    loop, thread = _on_loop_thread()
    restarts = RestartRequests(loop)
    died = ActorDied("engine 1", "generate", RuntimeError("gone"))
    made = []

    async def rollout():
        await restarts.ask(1, died, 6)  # returns only once the replacement is made
        return list(made)

    future = asyncio.run_coroutine_threadsafe(rollout(), loop)
    future.add_done_callback(lambda _: restarts.close())
    restarts.serve(lambda i, d, n: made.append((i, d, n, threading.current_thread())))
    assert future.result() == [(1, died, 6, threading.main_thread())]
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def test_a_failed_restart_raises_on_both_sides():
    loop, thread = _on_loop_thread()
    restarts = RestartRequests(loop)
    died = ActorDied("engine 0", "generate", RuntimeError("gone"))

    def spent(i, d):
        raise RuntimeError("cluster.max_engine_restarts spent")

    future = asyncio.run_coroutine_threadsafe(restarts.ask(0, died), loop)
    with pytest.raises(RuntimeError, match="max_engine_restarts"):
        restarts.serve(spent)
    with pytest.raises(RuntimeError, match="max_engine_restarts"):
        future.result(timeout=10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def test_a_serving_thread_watches_for_a_hang_between_requests():
    loop, thread = _on_loop_thread()
    restarts = RestartRequests(loop)
    polls = []

    def idle():
        polls.append(1)
        if len(polls) == 3:
            raise TimeoutError("hung")

    with pytest.raises(TimeoutError, match="hung"):
        restarts.serve(lambda *a: None, poll_s=0.01, idle=idle)
    assert len(polls) == 3
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def test_only_an_actor_death_is_an_engine_death():
    died = engine_death(2, "stats", RayActorError())
    assert isinstance(died, ActorDied) and str(died).startswith("engine 2 died (during stats): ")
    with pytest.raises(ValueError, match="own error"):
        engine_death(0, "generate", ValueError("the method's own error"))


def test_in_place_groups_go_home_while_there_is_room():
    """`homed_shares`: the sizes of `near_equal_shares`; a carried group in the share of the
    replica that parked its K/V while that share has room, the rest filling shares in order;
    `OpenGroup.replica` survives a checkpoint (an old state without it reads as None)."""
    from miles_like.rollouts.oversampling import homed_shares
    from miles_like.rollouts.partial import from_state, to_state

    def group(replica=None) -> OpenGroup:
        return OpenGroup(Problem("p", [1, 2], "a"), (), 1 if replica is not None else 0, replica)

    fresh = [group() for _ in range(5)]
    groups = [group(1), group(1), group(0), group(1), *fresh]  # 9 groups over 2: sizes 5, 4
    assert homed_shares(groups, 2) == [[2, 4, 5, 6, 7], [0, 1, 3, 8]]
    assert homed_shares(groups, 3) == [[2, 4, 5], [0, 1, 3], [6, 7, 8]]
    # four carried groups homed on replica 1, whose share has room for three: the fourth (and
    # a home beyond the replicas) fills in order like a fresh group
    crowded = [group(1), group(1), group(1), group(1), group(5), *fresh[:4]]
    assert homed_shares(crowded, 3) == [[3, 4, 5], [0, 1, 2], [6, 7, 8]]
    no_home = [group() for _ in range(7)]
    assert homed_shares(no_home, 2) == [list(r) for r in near_equal_shares(7, 2)]
    back = from_state(to_state(groups))
    assert [g.replica for g in back] == [g.replica for g in groups]
    assert "replica" not in to_state(fresh)[0]
