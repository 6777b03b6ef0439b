"""Ranks 1..k-1 of a tensor-parallel replica: no scheduler, they replay rank 0's commands.

Each follower holds its shard of the model and a KV pool of its KV heads with as many pages as
rank 0's. It loops on `TPGroup.receive`: a `Forward` replays rank 0's pool operations (page copies,
and the K/V of admitted prefill handoffs, of which it keeps its own heads), then runs the
same plan (same token ids, positions, slots) through its shard, joining the forward's
collectives; the logits it also receives are dropped (rank 0 samples). `GatherKV` sends its
heads of some slots to rank 0 (a prefill handoff's K/V, every head). `LoadWeights` takes this
rank's slice of the same tensors rank 0 loads; `Release` / `Resume` free and re-create the same
memory rank 0 does; `ReceiveShards` runs this rank's part of a weight push over the weight-sync
group (`shard_receive`, set by whoever joined that group); `Stop` ends the loop. Every collective
of a follower is issued by the thread running `serve`.

`run_rank` is the one entry point for every rank: rank 0 gets the `Engine`, the others serve
until rank 0's `Engine.close()`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from rollout import device_memory
from rollout.attention import TorchAttention
from rollout.build import kv_sizing, load_model
from rollout.config import EngineConfig, kv_storage_dtype
from rollout.engine import Engine
from rollout.kv_calibration import calibrate_kv_scales
from rollout.kv_pool import KVPool
from rollout.model_runner import execute
from rollout.tp_group import (
    CalibrateKV,
    Forward,
    GatherKV,
    LoadWeights,
    ReceiveShards,
    Release,
    Resume,
    Stop,
    TPGroup,
)
from rollout.weights import load_weights


def run_rank(config: EngineConfig, tp_group: dist.ProcessGroup | None = None) -> Engine | None:
    """Rank 0 of `tp_group` (default: the world): the replica's `Engine`. Any other rank: serve
    rank 0's commands until it closes the engine, then return None."""
    if config.tp > 1 and dist.is_initialized() and dist.get_rank(tp_group) != 0:
        EngineFollower(config, tp_group).serve()
        return None
    return Engine(config, tp_group)


class EngineFollower:
    def __init__(self, config: EngineConfig, tp_group: dist.ProcessGroup | None = None):
        self.tp = TPGroup(tp_group)
        if self.tp.size != config.tp or self.tp.rank == 0:
            raise ValueError(
                f"EngineConfig.tp={config.tp}: a follower is "
                f"rank 1..k-1 of a group of that size, got rank {self.tp.rank} of {self.tp.size}"
            )
        self.device = torch.device(config.device)
        self.config = config
        self.model_config, self.max_model_len, self.model, self.shards = load_model(config, self.tp)
        self._param_shapes = {n: p.shape for n, p in self.model.named_parameters()}
        # Construction order matches Engine's, so the page-count agreement pairs up.
        self.pool = KVPool(
            num_layers=self.model_config.num_layers,
            num_pages=self._kv_pages(),
            page_size=config.page_size,
            num_kv_heads=self.model.model.layers[0].self_attn.num_kv_heads,
            head_dim=self.model_config.head_dim,
            dtype=getattr(torch, config.dtype),
            device=self.device,
            storage_dtype=kv_storage_dtype(config),
        )
        self.pool.head_offset = self.tp.rank * self.pool.num_kv_heads
        self.attention = TorchAttention(self.pool)
        # the receive of this rank's own shards on the weight-sync group (`ReceiveShards`);
        # set by the process that joined that group
        self.shard_receive: Callable[[], None] | None = None

    def _kv_pages(self) -> int:
        """This rank's side of rank 0's pool sizing (a collective: the smallest count wins)."""
        return kv_sizing(self.config, self.model_config, self.max_model_len, self.tp).pages

    def load_weights(self, named_tensors) -> set[str]:
        """Copy (hf_name, tensor) pairs into this rank's shard in place: full tensors are
        narrowed, pre-sharded ones (the resharding sync sends this rank its own) copied as they
        are. Rank 0's `commit_weights` completes the replica's update."""
        return load_weights(
            self.model,
            named_tensors,
            tied_embeddings=self.model_config.tie_word_embeddings,
            require_all=False,
            shards=self.shards,
        )

    def serve(self) -> None:
        while True:
            command = self.tp.receive(self.device)
            if isinstance(command, Forward):
                self.pool.replay(command.pool_ops)
                execute(self.model, self.attention, command.plan)
            elif isinstance(command, GatherKV):
                self.pool.replay(command.pool_ops)
                for x in self.pool.read_slots(command.slots):
                    self.tp.gather_heads(x)
            elif isinstance(command, LoadWeights):
                try:
                    self.load_weights(command.named_tensors)
                except ValueError:
                    # Rank 0 fails on the same tensor: it raises to its caller and refuses
                    # to generate until a complete set arrives, which this rank then loads too.
                    pass
            elif isinstance(command, Release):
                self.pool.free_memory()
                if command.weights:
                    self.model.release_storage()
                device_memory.return_freed(self.device)
                self.tp.barrier()  # rank 0 waits until every rank has done it
            elif isinstance(command, Resume):
                if command.weights:
                    self.model.restore_storage(self._param_shapes)
                    self.tp.barrier()
                if command.kv:
                    if not self.pool.allocated:
                        self.pool.allocate(self._kv_pages())
                    self.tp.barrier()
            elif isinstance(command, ReceiveShards):
                if self.shard_receive is None:
                    raise RuntimeError("ReceiveShards before this rank joined a weight-sync group")
                self.shard_receive()
            elif isinstance(command, CalibrateKV):
                self.pool.set_scales(*calibrate_kv_scales(self.model))
            elif isinstance(command, Stop):
                return
            else:
                raise TypeError(
                    f"unknown tensor-parallel command {type(command).__name__} (engine bug)"
                )
