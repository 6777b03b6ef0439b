"""An engine rank's side of the weight push (`EngineWorker` delegates to it): buckets through
shared memory or as bytes, broadcasts, the commit, and in-place updates.

A replica's rank 0 takes full tensors for every rank (it forwards them to its TP followers in
step order); with the resharding sync every rank takes its own shards, loaded on that rank only,
and rank 0's commit completes the replica's update.

In-place updates (`in_place=True`; `rollout.partial: in_place`, async training): requests in
flight are kept, not drained. The first such load parks the step loop between two forward
passes (`AsyncEngine.hold`) and the commit releases it, so no forward pass ever runs on
half-updated weights; running requests continue on their old K/V with the new weights. The
rollout window stays as it was. Under engine TP only full tensors, not own shards.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import NamedTuple

from miles_like.run.rendezvous import collective_backend, take_held_store


class OwnShards(NamedTuple):
    """The receiver side of one TP rank's own shards (a `weight_sync` WeightReceiver): they are
    loaded on this rank only; rank 0's commit completes the replica's update."""

    load_weights: Callable
    commit_weights: Callable


class EngineLoader:
    """What the weight receivers load full tensors into: the engine, either idle (the default)
    or, while `keep_running` (an in-place update), with its requests kept between two steps."""

    def __init__(self, engine):
        self.engine = engine
        self.keep_running = False

    def load_weights(self, named_tensors) -> None:
        self.engine.load_weights(named_tensors, keep_running=self.keep_running)

    def load_weight_piece(self, name, shape, start, piece) -> bool:
        """A piece of a tensor split across buckets, in place where the engine can
        (`weight_sync.pieces`)."""
        return self.engine.load_weight_piece(
            name, shape, start, piece, keep_running=self.keep_running
        )

    def commit_weights(self) -> None:
        self.engine.commit_weights()


def follower_commit() -> None:
    """Followers hold no prefix cache and no version: rank 0 commits for the replica."""


class EngineWeightReceiver:
    """Weight updates into one engine rank. Rank 0 of a replica: `engine`, its `async_engine`
    and `close_window` (the worker's: stop admitting, wait for what is in flight). A TP
    follower: `follower` only (own shards)."""

    def __init__(
        self,
        engine=None,
        async_engine=None,
        close_window: Callable[[], None] | None = None,
        follower=None,
        tp_rank: int = 0,
    ):
        from weight_sync import BucketReceiver

        self.engine, self.async_engine, self.close_window = engine, async_engine, close_window
        self.tp_rank = tp_rank
        self.broadcast_receiver = None  # disaggregated: after `join_sync_group`
        self.own_shards_group = False  # that group carries this rank's own shards
        self.timeout_s = 0.0  # the sync group's
        self.follower = follower
        # streams of several trainer ranks run at once (`receive_stream`); each closes the
        # window (or opens an in-place update) before its first load, one at a time
        self._before_load_lock = threading.Lock()
        # a follower's receives run on its serving thread (`ReceiveShards`); their outcomes
        # come back here, to the controller's call
        self.received: queue.Queue = queue.Queue()
        if engine is None:
            self.loader = self.receiver = None
            self.shard_receiver = BucketReceiver(OwnShards(follower.load_weights, follower_commit))
            follower.shard_receive = self._receive_on_serving_thread
            return
        self.loader = EngineLoader(engine)
        self.receiver = BucketReceiver(self.loader)
        # the resharding sync: this rank's own shards, loaded here only
        self.shard_receiver = BucketReceiver(
            OwnShards(
                lambda tensors: engine.load_weights(tensors, all_ranks=False),
                engine.commit_weights,
            )
        )

    # ------------------------------------------------------------------------- in place
    def begin_in_place(self, own_shards: bool) -> None:
        if own_shards:
            raise RuntimeError(
                "an in-place weight update under engine TP takes full tensors through rank 0; "
                "the resharding sync (own shards) needs an idle replica"
            )
        if not self.loader.keep_running:
            self.async_engine.hold()
            self.loader.keep_running = True

    def end_in_place(self) -> None:
        """Release a parked step loop (a no-op unless an in-place update is open)."""
        if self.engine is not None and self.loader.keep_running:
            self.loader.keep_running = False
            self.async_engine.unhold()

    # -------------------------------------------------------------------------- buckets
    def load_bucket(self, handle, manifest, own_shards: bool, in_place: bool):
        self._before_load(own_shards, in_place)
        return self._bucket_receiver(own_shards).load(handle, manifest)

    def receive_stream(self, address, own_shards: bool, timeout_s: float, in_place: bool):
        """One colocated sync's buckets from one trainer rank, handed over on its socket
        (`weight_sync.receive_stream`); the receiver's report, as a dict. Calls for several
        ranks run at once (`EngineWorker`'s "weights" group), each on its own thread, into the
        same `BucketReceiver` (it loads one bucket at a time)."""
        from weight_sync import receive_stream

        self._before_load(own_shards, in_place)
        return receive_stream(address, self._bucket_receiver(own_shards), timeout_s)._asdict()

    def load_bucket_bytes(self, buffer, manifest, own_shards: bool, in_place: bool):
        self._before_load(own_shards, in_place)
        return self._bucket_receiver(own_shards).load_buffer(buffer, manifest)

    def _before_load(self, own_shards: bool, in_place: bool) -> None:
        if self.engine is None:
            return
        with self._before_load_lock:
            if in_place:
                self.begin_in_place(own_shards)
            else:
                self.close_window()

    def _bucket_receiver(self, own_shards: bool):
        if own_shards:
            return self.shard_receiver
        if self.engine is None:
            raise RuntimeError(
                f"engine TP rank {self.tp_rank} takes only its own shards; full tensors go to "
                "rank 0 (engine bug)"
            )
        return self.receiver

    def commit(self, in_place: bool) -> int:
        """Complete the update (one version bump, the prefix cache flushed); the version."""
        if not in_place:
            self.close_window()
            self.receiver.commit()
            return self.engine.weight_version
        self.begin_in_place(own_shards=False)  # a no-op after in-place loads
        try:
            self.receiver.commit()
        finally:
            self.end_in_place()
        return self.engine.weight_version

    # ------------------------------------------------------------------------- broadcast
    def join_sync_group(
        self,
        host: str,
        port: int,
        rank: int,
        num_engines: int,
        num_stages: int,
        timeout_s: float,
        own_shards: bool,
    ) -> None:
        """Join the broadcast group as its `rank`: rank 0 of a replica taking full tensors for
        every rank, or (`own_shards`, the resharding sync) any rank taking its own shards in the
        group of its TP rank index."""
        from weight_sync import BroadcastReceiver, SyncGroup

        group = SyncGroup.create(
            host,
            port,
            rank=rank,
            size=num_engines + num_stages,
            backend=collective_backend(),
            timeout_s=timeout_s,
            # rank 0 chose the port (`rendezvous`) and holds it
            master_store=take_held_store(port, timeout_s) if rank == 0 else None,
        )
        self.broadcast_receiver = BroadcastReceiver(
            self.shard_receiver.engine if own_shards else self.loader,
            group,
            sources=list(range(num_engines, num_engines + num_stages)),
        )
        self.own_shards_group, self.timeout_s = own_shards, timeout_s

    def _receive_on_serving_thread(self) -> None:
        """A follower's `ReceiveShards`, run by its serving thread: the outcome goes to the
        waiting `receive_broadcast`."""
        try:
            self.broadcast_receiver.receive()
        except Exception as e:  # noqa: BLE001 -- the controller's call reports it
            self.received.put(e)
        else:
            self.received.put(None)

    def receive_broadcast(self, in_place: bool) -> int:
        """Every bucket of one broadcast, then the commit; the version (-1 on a follower: its
        own shards only, rank 0 commits for the replica). `in_place`: requests keep running
        (the step loop stays parked for the whole receive, transfers included).

        Own shards under engine TP: one thread drives every collective of a rank, so rank 0
        sends its followers `ReceiveShards` between its other commands, and a follower's call
        only waits for its serving thread to have received."""
        if self.engine is None:
            try:
                failed = self.received.get(timeout=self.timeout_s + 60.0)
            except queue.Empty:
                raise TimeoutError(
                    f"engine TP rank {self.tp_rank}: no weight push received within "
                    f"{self.timeout_s + 60.0:.0f} s (rank 0 never sent ReceiveShards)"
                ) from None
            if failed is not None:
                raise failed
            return -1
        if not in_place:
            self.close_window()
            if self.own_shards_group and self.engine.tp is not None:
                from rollout.tp_group import ReceiveShards

                self.engine.tp.send(ReceiveShards())
            self.broadcast_receiver.receive()
            return self.engine.weight_version
        self.begin_in_place(own_shards=False)
        try:
            self.broadcast_receiver.receive()
        finally:
            self.end_in_place()
        return self.engine.weight_version
