"""User-facing configuration of the engine and of one generation request.

Both are frozen configs (`config_schema`): each field's type, range and choices are declared
with it and checked on construction, the rules between fields in `check`. A bad value raises one
`ConfigError` line (a `ValueError`) naming the field and what to do, before any model or memory
is touched.
"""

from __future__ import annotations

import typing
from typing import Annotated, Literal

import torch
from pydantic import Field

from config_schema import Config, Namer, Renamed, config
from rollout.kv_quant import KV_CACHE_DTYPES

Dtype = Literal["float32", "bfloat16", "float16", "float64"]
DTYPES = typing.get_args(Dtype)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, softmax and norms are computed in: float32, or float64 for a float64
    model (bf16 / fp16 models are upcast; a float64 model is never downcast)."""
    return torch.promote_types(dtype, torch.float32)


def kv_storage_dtype(config: EngineConfig) -> torch.dtype:
    """The dtype the KV pool stores K and V in (`kv_cache_dtype`)."""
    if config.kv_cache_dtype == "auto":
        return getattr(torch, config.dtype)
    return KV_CACHE_DTYPES[config.kv_cache_dtype]


@config
class EngineConfig(Config):
    RENAMED = {"tensor_parallel_size": Renamed("tp")}
    model_path: str
    """Local directory with a Hugging Face `config.json` and `*.safetensors` files."""
    device: str = "cpu"
    dtype: Dtype = "float32"
    kv_cache_tokens: int | None = Field(None, gt=0)
    """Size of the paged KV pool in tokens. None: `kv_memory_fraction` of free device memory."""
    kv_memory_fraction: float = Field(0.2, gt=0.0, le=1.0)
    """`kv_cache_tokens` None: the share of the device's free memory, measured when the pool is
    allocated (`Engine.alloc_kv`), that the pool takes."""
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = "auto"
    """How the KV pool stores K and V. auto: in `dtype`. fp8_e4m3: float8_e4m3fn with a
    power-of-two scale per (layer, KV head), calibrated from the weights at every load and
    weight update (`rollout.kv_calibration`): about half the bytes per token of bfloat16, so
    twice the tokens in the same memory; attention computes over the dequantized values."""
    page_size: int = Field(16, ge=1)
    """Tokens per KV page: the unit of allocation, of prefix sharing across requests (the radix
    cache matches whole pages) and of attention reads (whole pages gather at near-memcpy speed).
    Samples of one prompt share it entirely whatever the page size (a partial last page is
    copied)."""
    max_running_requests: int = Field(256, ge=1)
    """Most sequences decoding at once (each sample of a request counts)."""
    max_prefill_tokens: int = Field(4096, ge=1)
    """Chunked-prefill budget: most prompt tokens computed in one engine step."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt + completion. None: the model's `max_position_embeddings`."""
    enable_prefix_cache: bool = True
    """Radix-tree KV reuse across and within requests. Off: every sample prefills its prompt."""
    eos_token_ids: tuple[int, ...] | None = None
    """None: read from config.json / generation_config.json."""
    attention_backend: Literal["torch", "triton"] = "torch"
    """torch: every device; triton: the CUDA kernels for the KV store and decode
    (`rollout/kernels`), not for float64 (they compute in float32)."""
    decode_suffix_lanes: bool = True
    """torch backend: keep each decoding sequence's private suffix K/V in a persistent float32
    buffer updated in place, instead of gathering it from the pool every step (same results;
    memory bounded by the pool's size). Off: gather every step. Not used under tensor
    parallelism (the lanes' bookkeeping lives with the scheduler on rank 0)."""
    decode_graphs: bool | None = None
    """Pure decode steps at static shapes (`rollout.decode_graphs`): captured as CUDA graphs on a
    GPU. None: on with attention_backend="triton" on CUDA. True elsewhere runs the same static
    function eagerly (tests); it turns suffix lanes off."""
    compile: bool = False
    """`torch.compile` the forward outside attention (`rollout.compiled`: per layer, norm + q/k/v +
    rotary and o_proj + norm + SwiGLU MLP + residuals; the logits head), fused by inductor into
    C++ / OpenMP loops on CPU, Triton on GPU; inside the CUDA graphs of `decode_graphs`. The
    first steps pay the compilation (tens of seconds on a small CPU; inductor's on-disk cache
    makes later processes faster). Same function as eager up to rounding, so off by default
    (eager is the reference, and float64 runs stay exact); not with tensor parallelism."""
    speculative_method: Literal["ngram", "group", "draft"] | None = None
    """None (off), "ngram" (prompt lookup in the sequence itself), "group" (also the other
    samples and earlier completions of the same prompt) or "draft" (a smaller model with the same
    vocabulary, `speculative_draft_model_path`). Exact: outputs keep the target's distribution,
    and greedy output is unchanged."""
    num_speculative_tokens: int = Field(4, ge=1)
    speculative_ngram_min: int = Field(1, ge=1)
    speculative_ngram_max: int = Field(4, ge=1)
    speculative_draft_model_path: str | None = None
    """"draft": local Hugging Face directory of the draft model. Its weights stay as loaded (weight
    updates go to the target only)."""
    speculative_draft_kv_tokens: int | None = Field(None, gt=0)
    """"draft": the draft model's own paged KV pool, in tokens. None: as many as the target's pool.
    When it runs short, the least recently drafted sequences lose their draft KV (recomputed if they
    draft again); a sequence that still finds no room decodes without a draft that step."""
    speculative_min_acceptance: float = Field(0.25, ge=0.0, le=1.0)
    """Back-off: a verify step that accepts less than this share of its draft pauses that sequence's
    drafting, for 1, 2, 4, ... up to 64 steps while it keeps failing. 0 disables the back-off."""
    quantization: Literal["fp8"] | None = None
    """"fp8": the decoder layers' linear weights (q/k/v/o, gate/up/down, experts) held in
    float8_e4m3fn with a float32 scale per 128 x 128 block (`rollout.fp8_linear`), quantized
    when loaded from the checkpoint or by the weight sync's sender; embeddings, norms, router
    and LM head stay in `dtype`. Computes as the `dtype` engine would on the dequantized
    weights. None: every weight in `dtype`."""
    seed: int = 0
    """Seeds the generators of requests that give no seed of their own."""
    tp: int = Field(1, ge=1)
    """Processes (devices) one replica is sharded over: heads, KV heads, MLP and vocabulary split
    across ranks (`rollout.tp_follower.run_rank` starts each rank; rank 0 schedules and samples).
    k must divide the attention heads, KV heads and intermediate size. Under TP the engine runs
    the torch attention backend without suffix lanes, decode graphs or speculation."""

    def check(self, name: Namer) -> None:
        if not self.model_path:
            raise ValueError(
                f"{name('model_path')}: give the local directory holding config.json and "
                "*.safetensors"
            )
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError(
                f"{name('speculative_ngram_min')}={self.speculative_ngram_min} is above "
                f"{name('speculative_ngram_max')}={self.speculative_ngram_max}; lower it"
            )
        draft = self.speculative_method == "draft"
        if draft and self.speculative_draft_model_path is None:
            raise ValueError(
                f"{name('speculative_method')}='draft' needs "
                f"{name('speculative_draft_model_path')}: the local directory of a smaller "
                "model with the target's vocabulary"
            )
        if not draft and self.speculative_draft_model_path is not None:
            raise ValueError(
                f"{name('speculative_draft_model_path')} is set but "
                f"{name('speculative_method')}={self.speculative_method!r}; set it to 'draft' "
                "or drop the path"
            )
        if self.tp > 1:
            for field, ok, fix in (
                ("attention_backend", self.attention_backend == "torch", "'torch'"),
                ("decode_graphs", not self.decode_graphs, "false or null"),
                ("speculative_method", self.speculative_method is None, "null"),
                ("compile", not self.compile, "false"),
            ):
                if not ok:
                    raise ValueError(
                        f"{name(field)}={getattr(self, field)!r} is not supported with "
                        f"{name('tp')}={self.tp} yet; set it to {fix}"
                    )
        if self.kv_cache_dtype == "fp8_e4m3" and self.dtype == "float64":
            raise ValueError(
                f"{name('kv_cache_dtype')}='fp8_e4m3' with {name('dtype')}='float64' would throw "
                "away the exactness float64 runs exist for; use 'auto' (or a bfloat16 / float32 "
                "model)"
            )
        if self.attention_backend == "triton" and not self.device.startswith("cuda"):
            raise ValueError(
                f"{name('attention_backend')}='triton' needs a CUDA device "
                f"({name('device')}={self.device!r}); use 'torch' on CPU"
            )
        if self.quantization is not None and self.dtype == "float64":
            raise ValueError(
                f"{name('quantization')}={self.quantization!r} rounds weights far below what "
                f"a {name('dtype')}='float64' model is for (exact reference runs); use "
                f"bfloat16 or float32, or {name('quantization')} null"
            )
        if self.attention_backend == "triton" and self.dtype == "float64":
            raise ValueError(
                f"{name('attention_backend')}='triton' computes attention in float32, not "
                f"{name('dtype')}='float64'; use 'torch' for float64"
            )


@config
class SamplingParams(Config):
    n: int = Field(1, ge=1)
    """Samples per prompt. They share the prompt's KV: it is prefilled once."""
    temperature: float = Field(1.0, ge=0.0)
    """0 means greedy."""
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    """-1 (or 0) disables top-k."""
    min_p: float = Field(0.0, ge=0.0, lt=1.0)
    max_new_tokens: int = Field(128, ge=1)
    stop_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    """Token ids that end a sample (a list is kept as a tuple: params are hashable)."""
    seed: int | None = None
    """Sample j of the request draws from its own torch.Generator seeded with `seed + j`."""
    ignore_eos: bool = False
    park_kv: bool = False
    """A sample aborted mid-generation keeps its K/V in the engine (parked, across weight
    updates too) for its continuation: a later `park_kv` request whose prompt is exactly that
    sample's prompt + tokens adopts it instead of prefilling (`rollout.partial: in_place`).
    Parked K/V gives way to memory pressure; the continuation then prefills."""
    top_logprobs: int = Field(0, ge=0, le=20)
    """Per sampled token, the k most likely tokens and their log-probs over the full vocabulary,
    the same quantity as the sampled token's log-prob (log_softmax(logits / T), before
    truncation; T = 1 when greedy): `SampleOutput.top_logprobs`. 0: not computed. A sample that
    asks for them does not speculate (every token is sampled from its own logits row)."""
    prompt_logprobs: bool = False
    """The log-prob of each prompt token given the tokens before it (`RequestOutput.
    prompt_logprobs`, None for the first), log_softmax(logits) at temperature 1. The prompt is
    then computed in full, never taken from the prefix cache."""

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
