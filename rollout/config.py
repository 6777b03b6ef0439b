"""User-facing configuration of the engine and of one generation request.

Both are frozen dataclasses validated on construction: a bad value raises one `ValueError`
naming the field and what to do, before any model or memory is touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

DTYPES = ("float32", "bfloat16", "float16", "float64")


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype scores, softmax and norms are computed in: float32, or float64 for a float64
    model (bf16 / fp16 models are upcast; a float64 model is never downcast)."""
    return torch.promote_types(dtype, torch.float32)


ATTENTION_BACKENDS = (
    "torch",
    "triton",
)  # triton: GPU kernels for KV store and decode (rollout/kernels)
SPECULATIVE_METHODS = (None, "ngram", "group", "draft")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    """Local directory with a Hugging Face `config.json` and `*.safetensors` files."""
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_tokens: int | None = None
    """Size of the paged KV pool in tokens. None: `kv_memory_fraction` of free device memory."""
    kv_memory_fraction: float = 0.2
    page_size: int = 16
    """Tokens per KV page: the unit of allocation, of prefix sharing across requests (the radix
    cache matches whole pages) and of attention reads (whole pages gather at near-memcpy speed).
    Samples of one prompt share it entirely whatever the page size (a partial last page is
    copied)."""
    max_running_requests: int = 256
    """Most sequences decoding at once (each sample of a request counts)."""
    max_prefill_tokens: int = 4096
    """Chunked-prefill budget: most prompt tokens computed in one engine step."""
    max_model_len: int | None = None
    """Longest prompt + completion. None: the model's `max_position_embeddings`."""
    enable_prefix_cache: bool = True
    """Radix-tree KV reuse across and within requests. Off: every sample prefills its prompt."""
    eos_token_ids: tuple[int, ...] | None = None
    """None: read from config.json / generation_config.json."""
    attention_backend: str = "torch"
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
    speculative_method: str | None = None
    """None (off), "ngram" (prompt lookup in the sequence itself), "group" (also the other
    samples and earlier completions of the same prompt) or "draft" (a smaller model with the same
    vocabulary, `speculative_draft_model_path`). Exact: outputs keep the target's distribution,
    and greedy output is unchanged."""
    num_speculative_tokens: int = 4
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    speculative_draft_model_path: str | None = None
    """"draft": local Hugging Face directory of the draft model. Its weights stay as loaded (weight
    updates go to the target only)."""
    speculative_draft_kv_tokens: int | None = None
    """"draft": the draft model's own paged KV pool, in tokens. None: as many as the target's pool.
    When it runs short, the least recently drafted sequences lose their draft KV (recomputed if they
    draft again); a sequence that still finds no room decodes without a draft that step."""
    speculative_min_acceptance: float = 0.25
    """Back-off: a verify step that accepts less than this share of its draft pauses that sequence's
    drafting, for 1, 2, 4, ... up to 64 steps while it keeps failing. 0 disables the back-off."""
    seed: int = 0
    """Seeds the generators of requests that give no seed of their own."""
    tensor_parallel_size: int = 1
    """Processes (devices) one replica is sharded over: heads, KV heads, MLP and vocabulary split
    across ranks (`rollout.tp_follower.run_rank` starts each rank; rank 0 schedules and samples).
    k must divide the attention heads, KV heads and intermediate size. Under TP the engine runs
    the torch attention backend without suffix lanes, decode graphs or speculation."""

    def __post_init__(self) -> None:
        _require(
            isinstance(self.model_path, str) and self.model_path != "",
            "EngineConfig.model_path: give the local directory holding config.json and "
            "*.safetensors",
        )
        _require(self.dtype in DTYPES, f"EngineConfig.dtype={self.dtype!r}: choose one of {DTYPES}")
        _require(
            self.kv_cache_tokens is None
            or (isinstance(self.kv_cache_tokens, int) and self.kv_cache_tokens > 0),
            f"EngineConfig.kv_cache_tokens={self.kv_cache_tokens!r}: "
            "must be a positive int or None",
        )
        _require(
            0.0 < self.kv_memory_fraction <= 0.95,
            f"EngineConfig.kv_memory_fraction={self.kv_memory_fraction!r}: must be in (0, 0.95]",
        )
        _require(
            isinstance(self.page_size, int) and self.page_size >= 1,
            f"EngineConfig.page_size={self.page_size!r}: must be an int >= 1",
        )
        _require(
            isinstance(self.max_running_requests, int) and self.max_running_requests >= 1,
            f"EngineConfig.max_running_requests={self.max_running_requests!r}: must be an int >= 1",
        )
        _require(
            isinstance(self.max_prefill_tokens, int) and self.max_prefill_tokens >= 1,
            f"EngineConfig.max_prefill_tokens={self.max_prefill_tokens!r}: must be an int >= 1",
        )
        _require(
            self.max_model_len is None
            or (isinstance(self.max_model_len, int) and self.max_model_len >= 2),
            f"EngineConfig.max_model_len={self.max_model_len!r}: must be an int >= 2 or None",
        )
        _require(
            self.speculative_method in SPECULATIVE_METHODS,
            f"EngineConfig.speculative_method={self.speculative_method!r}: "
            f"choose one of {SPECULATIVE_METHODS}",
        )
        _require(
            isinstance(self.num_speculative_tokens, int) and self.num_speculative_tokens >= 1,
            f"EngineConfig.num_speculative_tokens={self.num_speculative_tokens!r}: "
            "must be an int >= 1",
        )
        _require(
            1 <= self.speculative_ngram_min <= self.speculative_ngram_max,
            "EngineConfig.speculative_ngram_min/max: need 1 <= min <= max",
        )
        _require(
            self.speculative_method != "draft"
            or isinstance(self.speculative_draft_model_path, str),
            "EngineConfig.speculative_method='draft' needs "
            "EngineConfig.speculative_draft_model_path: the "
            "local directory of a smaller model with the target's vocabulary",
        )
        _require(
            self.speculative_draft_model_path is None or self.speculative_method == "draft",
            f"EngineConfig.speculative_draft_model_path is set but EngineConfig.speculative_method="
            f"{self.speculative_method!r}; set it to 'draft' or drop the path",
        )
        _require(
            self.speculative_draft_kv_tokens is None
            or (
                isinstance(self.speculative_draft_kv_tokens, int)
                and self.speculative_draft_kv_tokens > 0
            ),
            f"EngineConfig.speculative_draft_kv_tokens={self.speculative_draft_kv_tokens!r}: "
            "must be a positive int or None",
        )
        _require(
            isinstance(self.speculative_min_acceptance, (int, float))
            and 0 <= self.speculative_min_acceptance <= 1,
            f"EngineConfig.speculative_min_acceptance={self.speculative_min_acceptance!r}: "
            "must be in [0, 1]",
        )
        _require(
            self.compile in (True, False),
            f"EngineConfig.compile={self.compile!r}: must be true or false",
        )
        _require(
            self.decode_graphs in (None, True, False),
            f"EngineConfig.decode_graphs={self.decode_graphs!r}: "
            "must be true, false or null (auto)",
        )
        _require(
            self.attention_backend in ATTENTION_BACKENDS,
            f"EngineConfig.attention_backend={self.attention_backend!r}: "
            f"choose one of {ATTENTION_BACKENDS}",
        )
        _require(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            f"EngineConfig.tensor_parallel_size={self.tensor_parallel_size!r}: must be an int >= 1",
        )
        if self.tensor_parallel_size > 1:
            k = self.tensor_parallel_size
            for name, ok, fix in (
                ("attention_backend", self.attention_backend == "torch", "'torch'"),
                ("decode_graphs", not self.decode_graphs, "false or null"),
                ("speculative_method", self.speculative_method is None, "null"),
                ("compile", not self.compile, "false"),
            ):
                _require(
                    ok,
                    f"EngineConfig.{name}={getattr(self, name)!r} is not supported with "
                    f"EngineConfig.tensor_parallel_size={k} yet; set it to {fix}",
                )
        _require(
            self.attention_backend != "triton" or self.device.startswith("cuda"),
            "EngineConfig.attention_backend='triton' needs a CUDA device "
            f"(device={self.device!r}); use 'torch' on CPU",
        )


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    """Samples per prompt. They share the prompt's KV: it is prefilled once."""
    temperature: float = 1.0
    """0 means greedy."""
    top_p: float = 1.0
    top_k: int = -1
    """-1 (or 0) disables top-k."""
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop_token_ids: list[int] | tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    """Sample j of the request draws from its own torch.Generator seeded with `seed + j`."""
    ignore_eos: bool = False
    park_kv: bool = False
    """A sample aborted mid-generation keeps its K/V in the engine (parked, across weight
    updates too) for its continuation: a later `park_kv` request whose prompt is exactly that
    sample's prompt + tokens adopts it instead of prefilling (`rollout.partial: in_place`).
    Parked K/V gives way to memory pressure; the continuation then prefills."""

    def __post_init__(self) -> None:
        _require(
            isinstance(self.n, int) and self.n >= 1,
            f"SamplingParams.n={self.n!r}: must be an int >= 1",
        )
        _require(
            self.temperature >= 0.0,
            f"SamplingParams.temperature={self.temperature!r}: must be >= 0 (0 = greedy)",
        )
        _require(0.0 < self.top_p <= 1.0, f"SamplingParams.top_p={self.top_p!r}: must be in (0, 1]")
        _require(
            isinstance(self.top_k, int) and (self.top_k == -1 or self.top_k >= 0),
            f"SamplingParams.top_k={self.top_k!r}: must be -1 (off) or an int >= 0",
        )
        _require(0.0 <= self.min_p < 1.0, f"SamplingParams.min_p={self.min_p!r}: must be in [0, 1)")
        _require(
            isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1,
            f"SamplingParams.max_new_tokens={self.max_new_tokens!r}: must be an int >= 1",
        )
        _require(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            f"SamplingParams.stop_token_ids={self.stop_token_ids!r}: "
            "must be non-negative token ids",
        )
        _require(
            self.seed is None or isinstance(self.seed, int),
            f"SamplingParams.seed={self.seed!r}: must be an int or None",
        )
        # Stored as a tuple so the params stay hashable and immutable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
