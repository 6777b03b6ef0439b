"""Weights in, by Hugging Face name: from `*.safetensors` on disk or from the trainer in memory.

`load_weights` is the single path for both. It copies into the existing parameters in place, so
tensor addresses never change (CUDA graphs and IPC consumers stay valid), and it validates every
name and shape before touching anything that could leave the model half-updated.

An engine holding FP8 layers (`rollout.fp8_linear`) takes their weights either quantized (the
FP8 tensor and its `*_scale_inv`, as the weight sync sends them) or in full precision, which it
quantizes itself after narrowing to its slice (`quantization.quantize`, the same function).

A tensor-parallel rank passes its `shards` (`rollout.parallel_layers.shard_spec`): a full Hugging
Face tensor is narrowed to the rank's slice, and a tensor already of the slice's shape (sent
pre-sharded) is copied as it is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from quantization import FP8_DTYPE, quantize, scale_name
from rollout import native
from rollout.parallel_layers import Shard

# Buffers some older checkpoints carry; they are recomputed from the config, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def iter_safetensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model_path={str(model_dir)!r}: no *.safetensors files there")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _resolve(params: dict[str, nn.Parameter], name: str, tied: bool) -> str:
    if name in params:
        return name
    if tied and name == "lm_head.weight":  # tied: lm_head shares the embedding's Parameter
        return "model.embed_tokens.weight"
    raise KeyError(name)


def copy_into(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """param.copy_(tensor). A column-major CPU weight (`CausalLM.column_major`) receiving a
    row-major tensor is filled by the native transposing copy: torch's strided copy there costs
    many times a plain copy of the same bytes, and it is what every weight update pays. A large
    plain copy on the CPU streams its stores past the cache (`native.stream_copy_`): the
    parameters are not read again before the next forward pass, and skipping the cache saves
    the read of each destination line an ordinary store does first."""
    if native.transposed_target(param, tensor):
        lib = native.transpose()
        if lib is not None:
            return native.transpose_copy_(lib, param, tensor)
    elif native.streamed_target(param, tensor):
        lib = native.transpose()
        if lib is not None:
            return native.stream_copy_(lib, param, tensor)
    param.copy_(tensor)


def piece_target(
    params: Mapping[str, torch.Tensor],
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    tied_embeddings: bool,
) -> tuple[str, torch.Tensor] | None:
    """The parameter (of `params`, a model's `named_parameters`) a whole tensor `name` of `shape`
    and `dtype` would be copied into unchanged (no slicing, no quantization, no transposition),
    and a flat view of its elements; None if loading it takes more than a copy. A tensor sent
    in pieces (`weight_sync`) is then loaded piece by piece, each a range of the flat view."""
    try:
        target_name = _resolve(params, name, tied_embeddings)
    except KeyError:
        return None
    param = params[target_name]
    if tuple(param.shape) != tuple(shape) or param.dtype != dtype or not param.is_contiguous():
        return None
    return target_name, param.view(-1)


@torch.no_grad()
def load_weights(
    model: nn.Module,
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    *,
    tied_embeddings: bool,
    require_all: bool,
    shards: Mapping[str, Shard] | None = None,
    params: Mapping[str, torch.Tensor] | None = None,
) -> set[str]:
    """Copy (hf_name, tensor) pairs into `model`'s parameters in place; returns the names set.

    `require_all`: every parameter must be given (a full checkpoint load); weight updates may be
    partial (bucketed). Unknown names and wrong shapes raise before the offending copy.
    `params`: `dict(model.named_parameters())`, if the caller keeps it (many small loads).
    """
    params = dict(model.named_parameters()) if params is None else params
    loaded: set[str] = set()
    for name, tensor in named_tensors:
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        try:
            target_name = _resolve(params, name, tied_embeddings)
        except KeyError:
            raise ValueError(
                f"weight {name!r} has no parameter in this model; expected Hugging Face "
                f"names such as {next(iter(params))!r}"
            ) from None
        param = params[target_name]
        shard = shards.get(target_name) if shards else None
        full_sized = (
            shard is not None
            and tensor.dim() == param.dim()
            and tensor.shape[shard.dim] == shard.full
        )
        if full_sized and tuple(tensor.shape) != tuple(param.shape):
            tensor = shard.take(tensor)  # a full tensor: this rank's slice
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"weight {name!r} has shape {tuple(tensor.shape)}, the model expects "
                f"{tuple(param.shape)}; is the checkpoint from the same config.json?"
            )
        if param.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE:
            # An FP8 layer given its weight in full precision (a checkpoint, or a sender that
            # does not quantize): this rank's slice quantized here, its scales with it.
            scale = scale_name(target_name)
            layer = model.get_submodule(target_name.rpartition(".")[0])
            quantized = quantize(tensor.to(param.device, layer.dtype))
            param.copy_(quantized.weight)
            params[scale].copy_(quantized.scale_inv)
            loaded.add(scale)
        elif tensor.dtype == FP8_DTYPE and param.dtype != FP8_DTYPE:
            raise ValueError(
                f"weight {name!r} arrives in FP8, but this engine holds it in {param.dtype}; "
                "quantize on the sender only for an engine with quantization='fp8'"
            )
        else:
            copy_into(param, tensor)
        loaded.add(target_name)
    if require_all:
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {missing[:3]}")
    return loaded


class WeightStatus:
    """Whether the engine's weights may serve generation: every one valid, and the last update
    committed. Releasing the weights' storage, or an update failing midway (the model is then a
    mix of old and new weights), makes them all invalid; the names loaded since are counted
    until every weight has arrived again."""

    def __init__(self, names: Iterable[str]):
        self.names = frozenset(names)
        self.reloaded: set[str] | None = None  # None: every weight is valid
        self.uncommitted = False  # loaded, `Engine.commit_weights` not yet called

    @property
    def complete(self) -> bool:
        return self.reloaded is None

    def invalidate(self) -> None:
        self.reloaded = set()

    def record(self, loaded: set[str]) -> None:
        if self.reloaded is not None:
            self.reloaded |= loaded
            if self.reloaded >= self.names:
                self.reloaded = None

    def check(self) -> None:
        """Raise, saying what to call, unless generation may run."""
        if self.reloaded is not None:
            raise RuntimeError(
                "engine weights are incomplete (released, or an update failed midway); "
                "call update_weights() with every weight before generating"
            )
        if self.uncommitted:
            raise RuntimeError(
                "a weight update was loaded but not committed; call commit_weights()"
            )
