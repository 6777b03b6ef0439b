"""Hugging Face names <-> megatron-core GPTModel parameters, under any TP x PP split.

Why our own mapping and not mbridge 0.15.1 (evaluated first, as the issue asked): mbridge
builds models with Transformer Engine layer specs unconditionally and needs CUDA when loading,
so it cannot run on the CPU path this project requires; it reads `rope_theta` the
transformers-4 way (top level), which transformers 5 moved into `rope_parameters`; and it turns
on sequence parallelism whenever TP > 1, which changes activation layouts our log-prob code
relies on. The mapping itself is small, so we own it here.

Layout rules (megatron side, per TP rank r of T, PP stage holding layers [off, off + n)):

* `embedding.word_embeddings.weight`, `output_layer.weight`: vocab rows padded with zeros to
  `padded_vocab_size` (divisible by T), split by rows; rank r holds rows [r V/T, (r+1) V/T).
* `linear_qkv`: per query group g the rows are [q heads of g; k_g; v_g] (each head `head_dim`
  rows), groups in order, then split by rows over T (groups never straddle ranks because
  `num_key_value_heads % T == 0`). Bias, when present, follows the same interleave.
* `linear_fc1`: rank r holds [gate rows of r; up rows of r] (megatron chunks fc1's output in 2).
* `linear_proj`, `linear_fc2`: row-parallel, split by input columns.
* norms and q/k-norm weights: replicated.
* decoder layer i on a stage is HF layer off + i.
* a mixture of experts' sparse layer: `mlp.router.weight` is HF's `mlp.gate.weight`
  (replicated); expert e's `linear_fc1` / `linear_fc2` map like the dense MLP's, to
  `mlp.experts.{e}.{gate,up}_proj` / `down_proj` (expert parallel 1: every rank holds every
  expert, split over TP); Qwen2-MoE's shared expert likewise (`mlp.shared_experts.*` <->
  `mlp.shared_expert.*`, its gate `mlp.shared_experts.gate_weight` <-> `mlp.shared_expert_gate`).

Export is a generator: each megatron parameter is all-gathered over TP on its own, converted
to HF tensors, and yielded, so peak extra memory is one full tensor. Under PP each stage yields
the layers it holds (with global HF indices); with tied embeddings only the first stage yields
`model.embed_tokens.weight` (the last stage's output layer is a synchronized copy).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from megatron.core import parallel_state
from safetensors import safe_open

import collectives
from model_spec import ModelSpec
from trainer.megatron_model import ModelLayout

_LAYER_PREFIX = "decoder.layers."
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(?P<index>\d+)\.linear_(?P<fc>fc1|fc2)\.weight")


class _Slot(NamedTuple):
    """One megatron parameter and the HF tensor(s) it is made of."""

    kind: str  # replicated | vocab | qkv | fc1 | row | column
    hf_names: tuple[str, ...]


def _layer_slot(arch: ModelSpec, local_name: str, hf_layer: int) -> _Slot | None:
    p = f"model.layers.{hf_layer}."
    attn = p + "self_attn."
    shared = p + "mlp.shared_expert"  # Qwen2-MoE
    table = {
        "input_layernorm.weight": _Slot("replicated", (p + "input_layernorm.weight",)),
        # Transformer Engine specs fuse the input norm into linear_qkv.
        "self_attention.linear_qkv.layer_norm_weight": _Slot(
            "replicated", (p + "input_layernorm.weight",)
        ),
        "self_attention.linear_qkv.weight": _Slot(
            "qkv", (attn + "q_proj.weight", attn + "k_proj.weight", attn + "v_proj.weight")
        ),
        "self_attention.linear_qkv.bias": _Slot(
            "qkv", (attn + "q_proj.bias", attn + "k_proj.bias", attn + "v_proj.bias")
        ),
        "self_attention.q_layernorm.weight": _Slot("replicated", (attn + "q_norm.weight",)),
        "self_attention.k_layernorm.weight": _Slot("replicated", (attn + "k_norm.weight",)),
        "self_attention.linear_proj.weight": _Slot("row", (attn + "o_proj.weight",)),
        "pre_mlp_layernorm.weight": _Slot("replicated", (p + "post_attention_layernorm.weight",)),
        "mlp.linear_fc1.layer_norm_weight": _Slot(
            "replicated", (p + "post_attention_layernorm.weight",)
        ),
        "mlp.linear_fc1.weight": _Slot(
            "fc1", (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")
        ),
        "mlp.linear_fc2.weight": _Slot("row", (p + "mlp.down_proj.weight",)),
        # a mixture of experts' sparse layer (trainer.megatron_moe): router and SequentialMLP
        "mlp.router.weight": _Slot("replicated", (p + "mlp.gate.weight",)),
        "mlp.shared_experts.gate_weight": _Slot("replicated", (shared + "_gate.weight",)),
        "mlp.shared_experts.linear_fc1.weight": _Slot(
            "fc1", (shared + ".gate_proj.weight", shared + ".up_proj.weight")
        ),
        "mlp.shared_experts.linear_fc2.weight": _Slot("row", (shared + ".down_proj.weight",)),
    }
    expert = _EXPERT.fullmatch(local_name)
    if expert is not None:
        e = f"{p}mlp.experts.{expert['index']}."
        if expert["fc"] == "fc1":
            return _Slot("fc1", (e + "gate_proj.weight", e + "up_proj.weight"))
        return _Slot("row", (e + "down_proj.weight",))
    return table.get(local_name)


def slot_for(arch: ModelSpec, layout: ModelLayout, megatron_name: str) -> _Slot:
    """The HF tensors behind one megatron parameter name of this rank's model."""
    if megatron_name.startswith(_LAYER_PREFIX):
        index, rest = megatron_name[len(_LAYER_PREFIX) :].split(".", 1)
        slot = _layer_slot(arch, rest, layout.layer_offset + int(index))
    else:
        slot = {
            "embedding.word_embeddings.weight": _Slot("vocab", ("model.embed_tokens.weight",)),
            "decoder.final_layernorm.weight": _Slot("replicated", ("model.norm.weight",)),
            "output_layer.weight": _Slot(
                "vocab",
                ("model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight",),
            ),
        }.get(megatron_name)
    if slot is None:
        raise KeyError(f"no Hugging Face mapping for megatron parameter {megatron_name!r}")
    return slot


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    while hasattr(model, "module"):  # megatron DDP / Float16Module wrappers
        model = model.module
    return model


def _local_params(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    # named_parameters() dedups shared tensors; with tied embeddings on one stage
    # output_layer.weight is None and the embedding serves both.
    yield from _unwrap(model).named_parameters()


# ---------------------------------------------------------------------------------------------
# HF -> megatron


def _qkv_full(arch: ModelSpec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """HF q/k/v (rows = heads x head_dim) -> megatron's per-group interleave (rows first)."""
    g, d = arch.num_kv_heads, arch.head_dim
    per = arch.num_heads // g
    tail = q.shape[1:]
    q = q.reshape(g, per * d, *tail)
    k = k.reshape(g, d, *tail)
    v = v.reshape(g, d, *tail)
    return torch.cat([q, k, v], dim=1).reshape(g * (per + 2) * d, *tail)


def _shard(
    arch: ModelSpec, layout: ModelLayout, slot: _Slot, hf: list[torch.Tensor], tp: int, rank: int
) -> torch.Tensor:
    if slot.kind == "replicated":
        return hf[0]
    if slot.kind == "vocab":
        w = hf[0]
        padded = w.new_zeros((layout.padded_vocab_size,) + tuple(w.shape[1:]))
        padded[: w.shape[0]] = w
        return padded.chunk(tp, dim=0)[rank]
    if slot.kind == "qkv":
        return _qkv_full(arch, *hf).chunk(tp, dim=0)[rank]
    if slot.kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[rank], up.chunk(tp, dim=0)[rank]], dim=0)
    if slot.kind == "row":
        return hf[0].chunk(tp, dim=1)[rank]
    raise AssertionError(slot.kind)


class HFCheckpoint:
    """Lazy reader of a HF safetensors checkpoint directory (single file or sharded)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif (self.directory / "model.safetensors").exists():
            with safe_open(self.directory / "model.safetensors", framework="pt") as f:
                weight_map = {k: "model.safetensors" for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"no model.safetensors or model.safetensors.index.json in {self.directory}; "
                "point model_path at a Hugging Face checkpoint directory"
            )
        self.weight_map: dict[str, str] = weight_map

    def config(self) -> dict:
        path = self.directory / "config.json"
        if not path.exists():
            raise FileNotFoundError(f"no config.json in {self.directory}")
        return json.loads(path.read_text())

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"tensor {name!r} missing from the checkpoint in {self.directory}")
        with safe_open(self.directory / self.weight_map[name], framework="pt") as f:
            return f.get_tensor(name)


def load_hf_weights(
    model: torch.nn.Module,
    arch: ModelSpec,
    layout: ModelLayout,
    source: HFCheckpoint | dict[str, torch.Tensor],
    skip_prefixes: tuple[str, ...] = (),
) -> None:
    """Copy HF weights into this rank's shard; every local parameter must be covered, except
    those under `skip_prefixes` (e.g. a critic's value head, which HF checkpoints lack)."""
    get = source.get if isinstance(source, HFCheckpoint) else source.__getitem__
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in _local_params(model):
            if name.startswith(skip_prefixes):
                continue
            slot = slot_for(arch, layout, name)
            value = _shard(arch, layout, slot, [get(n) for n in slot.hf_names], tp, rank)
            if value.shape != param.shape:
                raise ValueError(
                    f"{name}: HF tensors {slot.hf_names} give shape "
                    f"{tuple(value.shape)}, megatron expects {tuple(param.shape)}"
                )
            param.copy_(value)


# ---------------------------------------------------------------------------------------------
# megatron -> HF


def _gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    """The full tensor of TP shards `t`, on `t`'s device: a shard offloaded to the host (a
    checkpoint after `offload`) is gathered on the group's device and comes back to the host."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return t
    return collectives.all_gather(
        t, dim=dim, group=parallel_state.get_tensor_model_parallel_group()
    )


def _to_hf(arch: ModelSpec, slot: _Slot, local: torch.Tensor) -> list[torch.Tensor]:
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if slot.kind == "replicated":
        return [local]
    if slot.kind == "vocab":
        return [_gather_tp(local, 0)[: arch.vocab_size]]
    if slot.kind == "row":
        return [_gather_tp(local, 1)]
    if slot.kind == "fc1":
        parts = [p.chunk(2, dim=0) for p in _gather_tp(local, 0).chunk(tp, dim=0)]
        return [torch.cat([g for g, _ in parts]), torch.cat([u for _, u in parts])]
    if slot.kind == "qkv":
        g, d = arch.num_kv_heads, arch.head_dim
        per = arch.num_heads // g
        full = _gather_tp(local, 0)
        tail = full.shape[1:]
        grouped = full.reshape(g, (per + 2) * d, *tail)
        q, k, v = grouped.split([per * d, d, d], dim=1)
        return [q.reshape(g * per * d, *tail), k.reshape(g * d, *tail), v.reshape(g * d, *tail)]
    raise AssertionError(slot.kind)


def export_hf_weights(
    model: torch.nn.Module, arch: ModelSpec, layout: ModelLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for the parameters this PP stage holds, one at a time.

    Every TP rank of the stage must iterate it (each tensor is an all-gather); all ranks get the
    same tensors. Fused layouts (TE) yield a shared norm only once."""
    seen: set[str] = set()
    for name, param in _local_params(model):
        slot = slot_for(arch, layout, name)
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            continue  # synchronized copy of the first stage's embedding
        tensors = _to_hf(arch, slot, param.detach())
        for hf_name, t in zip(slot.hf_names, tensors):
            if hf_name not in seen:
                seen.add(hf_name)
                yield hf_name, t


def gather_hf_state_dict(
    model: torch.nn.Module, arch: ModelSpec, layout: ModelLayout
) -> dict[str, torch.Tensor]:
    """The full HF state dict on every rank (collects PP stages). For tests and checkpoints;
    the weight-sync path streams `export_hf_weights` instead."""
    local = {k: v.cpu().clone() for k, v in export_hf_weights(model, arch, layout)}
    stages = collectives.all_gather_object(
        local, parallel_state.get_pipeline_model_parallel_group()
    )
    merged: dict[str, torch.Tensor] = {}
    for part in stages:
        merged.update(part)
    return merged


# ---------------------------------------------------------------------------------------------
# megatron -> an engine's tensor-parallel shards (resharding sync)


def engine_vocab_rows(vocab: int, engine_tp: int, engine_rank: int) -> tuple[int, int]:
    """(start, length) of an engine TP rank's vocabulary rows (`rollout.tp_group.vocab_split`:
    chunks of ceil(vocab / k), the last one shorter)."""
    chunk = -(-vocab // engine_tp)
    start = min(engine_rank * chunk, vocab)
    return start, min(chunk, vocab - start)


def _vocab_to_engine(local: torch.Tensor, vocab: int) -> torch.Tensor:
    """This trainer TP rank's megatron vocab rows -> the engine rank of the same index's rows.

    Megatron splits the padded vocabulary in T equal chunks, the engine the real one in chunks of
    ceil(V / T): the rows rank r needs may live on other ranks. Each rank sends every other rank
    exactly the rows that rank needs (one all-to-all), so no rank ever holds the full tensor."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    group = parallel_state.get_tensor_model_parallel_group()
    held = local.shape[0]  # megatron rows [rank * held, (rank + 1) * held) of the padded vocab

    def overlap(src: int, dst: int) -> tuple[int, int]:
        start, length = engine_vocab_rows(vocab, tp, dst)
        lo, hi = max(start, src * held), min(start + length, (src + 1) * held)
        return lo, max(0, hi - lo)

    if _layouts_agree(vocab, tp, held):  # the same rows on every rank: nothing to exchange
        return local[: engine_vocab_rows(vocab, tp, rank)[1]]
    send_spans = [overlap(rank, dst) for dst in range(tp)]
    send = torch.cat([local[lo - rank * held : lo - rank * held + n] for lo, n in send_spans])
    out_rows = [overlap(src, rank)[1] for src in range(tp)]
    out = local.new_empty((sum(out_rows),) + tuple(local.shape[1:]))
    return collectives.all_to_all_single(
        out, send, out_rows, [n for _, n in send_spans], group=group
    )


def _layouts_agree(vocab: int, tp: int, held: int) -> bool:
    """Megatron's chunks of `held` rows start where the engine's do on every rank."""
    return all(engine_vocab_rows(vocab, tp, r)[0] == min(r * held, vocab) for r in range(tp))


def export_engine_shards(
    model: torch.nn.Module, arch: ModelSpec, layout: ModelLayout
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, tensor) for an engine with this trainer's TP size: the tensors engine TP
    rank r loads, computed on trainer TP rank r from its own shard, never gathered.

    The engine (`rollout/parallel_layers.py`) splits q/k/v by heads and gate/up by rows (column
    parallel), o/down by input columns (row parallel), the embedding and LM head by vocabulary
    rows in chunks of ceil(V / T); norms are whole. Megatron's shard of rank r holds the same
    heads (query groups never straddle ranks), the same gate/up rows and the same input columns,
    so those are a local de-interleave; only vocabulary rows may cross ranks (padding differs:
    `_vocab_to_engine`). Every TP rank of the stage must iterate it (the vocabulary exchange is
    a collective)."""
    seen: set[str] = set()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    for name, param in _local_params(model):
        slot = slot_for(arch, layout, name)
        if name == "output_layer.weight" and arch.tie_word_embeddings:
            continue
        local = param.detach()
        if slot.kind in ("replicated", "row"):
            tensors = [local]
        elif slot.kind == "vocab":
            tensors = [_vocab_to_engine(local, arch.vocab_size)]
        elif slot.kind == "fc1":
            tensors = list(local.chunk(2, dim=0))
        elif slot.kind == "qkv":
            g, d = arch.num_kv_heads // tp, arch.head_dim
            per = arch.num_heads // arch.num_kv_heads
            tail = local.shape[1:]
            q, k, v = local.reshape(g, (per + 2) * d, *tail).split([per * d, d, d], dim=1)
            tensors = [
                q.reshape(g * per * d, *tail),
                k.reshape(g * d, *tail),
                v.reshape(g * d, *tail),
            ]
        else:
            raise AssertionError(slot.kind)
        for hf_name, t in zip(slot.hf_names, tensors):
            if hf_name not in seen:
                seen.add(hf_name)
                yield hf_name, t
