"""An engine's parts, built from its `EngineConfig`: the model (this rank's shard under tensor
parallelism) with its weights, the KV pool sized against free memory, the proposer for
speculative decoding, the scheduler, the attention backend (and suffix lanes), the model runner
and the static-shape decode steps.

The switches interact here and nowhere else:
* `attention_backend="triton"` takes the Triton kernels; "torch" takes `TorchAttention`, with
  suffix lanes when `decode_suffix_lanes` is on, decode graphs are off and there is no TP (static
  steps would not update lanes; under TP their bookkeeping would need replaying on every rank);
* `decode_graphs` (default: on CUDA with the Triton backend) gives the pool a scratch page for
  padded rows;
* `compile` replaces the forward's pieces by compiled ones; otherwise, on the CPU in float32,
  the C kernels' pieces are used where they apply;
* under TP the pool logs its page copies, which rank 0 sends to the other ranks with each forward;
* a mixture of experts runs its experts per expert group, whose shapes depend on the routes:
  neither `decode_graphs` (off by default for it) nor `compile` applies; rank 0's pool keeps the
  routes beside the K/V (`rollout.routes`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from model_spec import ModelSpec
from rollout import device_memory, host_heap
from rollout.attention import TorchAttention, decode_kv_dtype
from rollout.compiled import compile_model
from rollout.config import EngineConfig, kv_storage_dtype
from rollout.decode_graphs import DecodeGraphs
from rollout.kv_pool import KVPool
from rollout.model import CausalLM
from rollout.model_runner import ModelRunner
from rollout.moe import check_moe_divisible
from rollout.native import layers as native_layers
from rollout.parallel_layers import Shard, check_divisible, shard_spec
from rollout.routes import RouteLayout
from rollout.scheduler import Scheduler
from rollout.speculative.draft_model import DraftModelProposer
from rollout.speculative.drafting import Speculation
from rollout.speculative.lookup import Proposer
from rollout.suffix_lanes import SuffixLanes
from rollout.tp_group import TPGroup
from rollout.weights import iter_safetensors, load_weights

if TYPE_CHECKING:
    from rollout.kernels import TritonAttention


class LoadedModel(NamedTuple):
    model_config: ModelSpec
    max_model_len: int
    model: CausalLM  # this rank's shard under tensor parallelism
    shards: dict[str, Shard]  # how each sliced parameter comes from the full tensor ({} without TP)


class EngineParts(NamedTuple):
    model_config: ModelSpec
    max_model_len: int
    model: CausalLM
    shards: dict[str, Shard]
    eos_token_ids: frozenset[int]
    pool: KVPool
    draft_model: DraftModelProposer | None  # speculative_method="draft" only
    scheduler: Scheduler
    attention: TorchAttention | TritonAttention
    suffix_lanes: SuffixLanes | None
    runner: ModelRunner
    decode_graphs: DecodeGraphs | None
    kv_sizing: KVSizing


class KVSizing(NamedTuple):
    """How the KV pool was sized: the device's free memory measured just before (`time.time()`
    of the measurement), and the pages it got."""

    free_bytes: int
    measured_at: float
    pages: int


def replica_group(config: EngineConfig, group: dist.ProcessGroup | None) -> TPGroup | None:
    """The TP group whose rank 0 this engine is (`tp` > 1), or None."""
    if config.tp == 1:
        return None
    tp = TPGroup(group)
    if (tp.size, tp.rank) != (config.tp, 0):
        raise ValueError(
            f"EngineConfig.tp={config.tp}: "
            "the Engine is rank 0 of a group of that size, got rank "
            f"{tp.rank} of {tp.size}; start every rank with "
            "rollout.tp_follower.run_rank"
        )
    return tp


def build_parts(config: EngineConfig, tp: TPGroup | None) -> EngineParts:
    """Everything an `Engine` (rank 0 of `tp`, if any) runs on."""
    mc, max_model_len, model, shards = load_model(config, tp)
    refuse_for_moe(config, mc)
    if config.compile:
        compile_model(model)  # compiles lazily, at the first forward of each shape kind
    elif native_layers.applies(model):
        native_layers.use_native_pieces(model)
    device, dtype = torch.device(config.device), getattr(torch, config.dtype)
    eos = config.eos_token_ids if config.eos_token_ids is not None else mc.eos_token_ids
    use_graphs = (
        config.decode_graphs
        if config.decode_graphs is not None
        else device.type == "cuda" and config.attention_backend == "triton" and mc.moe is None
    )
    sizing = kv_sizing(config, mc, max_model_len, tp)
    pool = KVPool(
        num_layers=mc.num_layers,
        num_pages=sizing.pages,
        page_size=config.page_size,
        num_kv_heads=model.model.layers[0].self_attn.num_kv_heads,  # this rank's, under TP
        head_dim=mc.head_dim,
        dtype=dtype,
        device=device,
        scratch_page=use_graphs,
        route_layout=RouteLayout.of(mc.moe),
        storage_dtype=kv_storage_dtype(config),
    )
    draft_model = (
        DraftModelProposer(
            config.speculative_draft_model_path,
            vocab_size=mc.vocab_size,
            max_model_len=max_model_len,
            max_sequences=config.max_running_requests,
            kv_tokens=config.speculative_draft_kv_tokens or pool.num_slots,
            page_size=config.page_size,
            dtype=dtype,
            device=device,
        )
        if config.speculative_method == "draft"
        else None
    )
    proposer = draft_model or (
        Proposer(
            config.speculative_method,
            config.speculative_ngram_min,
            config.speculative_ngram_max,
        )
        if config.speculative_method
        else None
    )
    scheduler = Scheduler(
        pool=pool,
        max_running_requests=config.max_running_requests,
        max_prefill_tokens=config.max_prefill_tokens,
        max_model_len=max_model_len,
        enable_prefix_cache=config.enable_prefix_cache,
        eos_token_ids=frozenset(eos),
        speculation=Speculation(
            proposer, config.num_speculative_tokens, config.speculative_min_acceptance
        )
        if proposer is not None
        else None,
    )
    if tp is not None:
        pool.copy_log = []
        pool.head_offset = tp.rank * pool.num_kv_heads
    suffix_lanes = None
    if config.attention_backend == "triton":
        from rollout.kernels import TritonAttention  # triton decides interpret vs compile here

        if (
            pool.quantized
            and device.type == "cuda"
            and torch.cuda.get_device_capability(device) < (8, 9)
        ):
            raise ValueError(
                "EngineConfig.kv_cache_dtype='fp8_e4m3' with attention_backend='triton' needs a "
                "GPU with float8 support (compute capability 8.9+, Ada / Hopper); use "
                "attention_backend='torch' on this one"
            )

        attention = TritonAttention(pool)
    else:
        if config.decode_suffix_lanes and not use_graphs and tp is None:
            # Bounded by the pool's own bytes (lanes are in the dtype decode attention reads, the
            # pool in its storage dtype).
            lane_dtype = decode_kv_dtype(pool)
            lane_bytes = torch.empty((), dtype=lane_dtype).element_size()
            suffix_lanes = SuffixLanes(
                pool, pool.num_slots * pool.k.element_size() // lane_bytes, lane_dtype
            )
        attention = TorchAttention(pool, suffix_lanes)
    runner = ModelRunner(model, attention, scheduler.slot_table, config.page_size)
    decode_graphs = (
        DecodeGraphs(model, attention, pool, scheduler.slot_table, config.max_running_requests)
        if use_graphs
        else None
    )
    return EngineParts(
        mc,
        max_model_len,
        model,
        shards,
        frozenset(eos),
        pool,
        draft_model,
        scheduler,
        attention,
        suffix_lanes,
        runner,
        decode_graphs,
        sizing,
    )


def refuse_for_moe(config: EngineConfig, mc: ModelSpec) -> None:
    """One line for a switch a mixture of experts cannot take (see the module docstring)."""
    if mc.moe is None:
        return
    for field, value in (("decode_graphs", config.decode_graphs), ("compile", config.compile)):
        if value:
            raise ValueError(
                f"EngineConfig.{field}=True is not supported for the mixture-of-experts model "
                f"{mc.model_type!r} (its experts' shapes depend on the routes); set {field} to "
                "false"
            )


def load_model(config: EngineConfig, tp: TPGroup | None) -> LoadedModel:
    """The model (or this TP rank's shard of it) with the checkpoint's weights loaded."""
    model_dir = Path(config.model_path)
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"EngineConfig.model_path={config.model_path!r} is not a "
            "directory; give a local Hugging Face model directory"
        )
    mc = ModelSpec.from_dir(model_dir)
    if tp is not None:
        check_divisible(mc.num_heads, mc.num_kv_heads, mc.intermediate_size, tp.size)
        check_moe_divisible(mc, tp.size)
    max_model_len = config.max_model_len or mc.max_position_embeddings
    if max_model_len > mc.max_position_embeddings:
        raise ValueError(
            f"EngineConfig.max_model_len={max_model_len} exceeds the model's "
            f"max_position_embeddings={mc.max_position_embeddings}; lower it"
        )
    model = CausalLM.build(
        mc,
        max_model_len,
        getattr(torch, config.dtype),
        torch.device(config.device),
        tp,
        config.quantization,
    )
    shards = shard_spec(model)
    load_weights(
        model,
        iter_safetensors(model_dir),
        tied_embeddings=mc.tie_word_embeddings,
        require_all=True,
        shards=shards,
    )
    if torch.device(config.device).type == "cpu":  # after the load: weights placed as before
        host_heap.keep_freed_memory()
    return LoadedModel(mc, max_model_len, model, shards)


def kv_sizing(
    config: EngineConfig, mc: ModelSpec, max_model_len: int, tp: TPGroup | None
) -> KVSizing:
    """Pages of the KV pool: `kv_cache_tokens`, or `kv_memory_fraction` of the device's free
    memory measured now. Every rank of a TP replica gets the same count (the smallest any rank
    can hold), since rank 0's scheduler allocates for all of them: a collective, so every rank
    calls it at the same point."""
    device = torch.device(config.device)
    free, measured_at = device_memory.free_bytes(device), time.time()
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
    else:
        kv_heads = mc.num_kv_heads // (tp.size if tp is not None else 1)
        per_token = KVPool.bytes_per_token(
            mc.num_layers, kv_heads, mc.head_dim, kv_storage_dtype(config)
        )
        # No point holding more than every running sequence at full length.
        tokens = min(
            int(config.kv_memory_fraction * free) // per_token,
            config.max_running_requests * max_model_len,
        )
    pages = max(1, -(-tokens // config.page_size))
    if tp is not None:
        pages = tp.min_int(pages, device)
    return KVSizing(free, measured_at, pages)
