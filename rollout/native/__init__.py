"""The engine's C kernels for the CPU, float32: cascade decode attention (cascade_decode.c),
causal prefill attention (prefill_attention.c, float32 and bfloat16 inputs, float32 arithmetic;
in bfloat16 on AMX tiles where the CPU has them, the probabilities rounded to bfloat16), the
element-wise steps of a layer (pointwise.c: RMSNorm, rotary, SiLU * up, K/V row stores; all in
bfloat16 too, rounding where the torch reference's bfloat16 ops round) and
sampling without truncation (sampling.c: each row's draw and log-prob in one pass), and the
transposing copy that fills a column-major weight from a row-major update (transpose.c, any
2-, 4- or 8-byte dtype), and the streaming copy of large plain weight updates (same file).

Each source is built on first use by `native_build` with OpenMP; the kernels run on torch's
threads (`torch.get_num_threads()`, the process's one libgomp). Without a compiler, with
MILES_LIKE_NATIVE=0, or where a build fails, `attention()` / `pointwise()` return None after one
warning and the engine runs its torch code instead: the same functions (tests compare each kernel
with its torch reference). `rollout.native.layers` holds the model pieces built on them.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from pathlib import Path

import torch

import native_build

FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# The same build without AMX tiles: on a CPU with them, the AVX-512 paths they replace (tests and
# benchmarks/prefill_attention_amx.py run both).
NO_AMX_FLAGS = [*FLAGS, "-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
_I64, _PTR, _F32, _INT = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int


def declare_attention(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.cascade_decode_f32.argtypes = [
        *(_I64,) * 5,  # D, Hkv, R, Dh, rows_per_bias
        *(_PTR, _I64),  # q, its sequence stride
        *(_PTR, _PTR, _I64, _I64, _I64, _PTR),  # suffix K, V, strides, Ls, bias
        *(_PTR, _PTR, _I64, _I64, _I64, _PTR),  # prefix K, V, head / group strides, Lp, bias
        *(_PTR, _I64, _F32, _PTR, _INT),  # group_of, G, scale, out, threads
    ]
    lib.cascade_decode_f32.restype = _INT
    lib.cascade_decode_bf16.argtypes = lib.cascade_decode_f32.argtypes
    lib.cascade_decode_bf16.restype = _INT
    lib.cascade_decode_has_avx2.restype = lib.cascade_decode_has_bf16_dot.restype = _INT
    if hasattr(lib, "cascade_decode_has_amx"):  # older sources (a benchmark's baseline) lack it
        lib.cascade_decode_has_amx.restype = _INT
    return lib


def declare_prefill(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.prefill_attention.argtypes = [
        *(_I64,) * 6,  # count, n, C, H, Hkv, Dh
        *(_PTR, _I64, _I64),  # q, its chunk and token strides
        *(_PTR, _PTR, _I64, _I64, _I64),  # K, V, their chunk, head and token strides
        *(_PTR, _I64, _I64),  # out, its chunk and token strides
        *(_F32, _INT, _INT),  # scale, bfloat16?, threads
    ]
    lib.prefill_attention.restype = _INT
    lib.prefill_attention_has_avx512.restype = lib.prefill_attention_has_amx.restype = _INT
    return lib


def declare_pointwise(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.rms_norm_f32.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _F32, _PTR, _I64, _I64, _I64, _INT]
    lib.rotary_f32.argtypes = [_PTR, _I64, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _INT]
    lib.silu_mul_f32.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT]
    lib.scatter_rows_f32.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64, _I64, _INT]
    lib.rms_norm_f32.restype = lib.silu_mul_f32.restype = None
    lib.rotary_f32.restype = lib.scatter_rows_f32.restype = _INT
    lib.rms_norm_bf16.argtypes = [_PTR, _I64, _PTR, _F32, _PTR, _I64, _I64, _I64, _INT]
    lib.rotary_bf16.argtypes = lib.rotary_f32.argtypes
    lib.scatter_rows_16.argtypes = lib.scatter_rows_f32.argtypes
    lib.silu_mul_bf16.argtypes = lib.silu_mul_f32.argtypes
    lib.rms_norm_bf16.restype = lib.silu_mul_bf16.restype = None
    lib.add_rms_norm_bf16.argtypes = lib.rms_norm_f32.argtypes
    lib.add_rms_norm_bf16.restype = None
    lib.scatter_kv_rows.argtypes = [
        *(_PTR,) * 2,
        _I64,
        _I64,
        *(_PTR,) * 2,
        _I64,
        _PTR,
        *(_I64,) * 3,
        _INT,
    ]
    lib.scatter_kv_rows.restype = _INT
    lib.rotary_bf16.restype = lib.scatter_rows_16.restype = _INT
    lib.pointwise_has_avx2.restype = _INT
    return lib


def declare_sampling(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.sample_rows_f32.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _INT]
    lib.sample_rows_f32.restype = None
    lib.sampling_has_avx2.restype = _INT
    return lib


def declare_transpose(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.transpose_copy.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _I64, _I64, _INT]
    lib.transpose_copy.restype = _INT
    lib.stream_copy.argtypes = [_PTR, _PTR, _I64]
    lib.stream_copy.restype = None
    lib.transpose_has_avx2.restype = _INT
    return lib


def declare_small_gemm(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.small_gemm.argtypes = [
        *(_I64,) * 3,  # M, N, K
        *(_PTR, _I64, _PTR, _I64),  # x, its row stride, weight, its output stride
        *(_PTR, _PTR, _I64, _PTR, _I64),  # bias, residual, its row stride, y, its row stride
        *(_INT, _INT),  # bfloat16?, threads
    ]
    lib.small_gemm.restype = None
    lib.small_gemm_prepared.argtypes = [
        *(_I64,) * 3,  # M, N, K
        *(_INT, _PTR, _I64, _PTR, _F32),  # transform, x, its row stride, norm weight, eps
        *(_PTR, _I64),  # weight, its output stride
        *(_PTR, _PTR, _I64, _PTR, _I64),  # bias, residual, its row stride, y, its row stride
        _INT,  # threads
    ]
    lib.small_gemm_prepared.restype = _INT
    lib.small_gemm_has_avx512.restype = lib.small_gemm_has_bf16_dot.restype = _INT
    lib.small_gemm_has_amx.restype = lib.small_gemm_cpu_is_intel.restype = _INT
    # the dtypes its vector code is built for here (AVX-512; AVX-512 BF16 for bfloat16): where
    # the engine uses it (the portable build is for tests and for correctness elsewhere)
    lib.vector_dtypes = (
        ((torch.float32,) + ((torch.bfloat16,) if lib.small_gemm_has_bf16_dot() else ()))
        if lib.small_gemm_has_avx512()
        else ()
    )
    return lib


def _library(source: str, declare: Callable[[ctypes.CDLL], ctypes.CDLL], what: str):
    return native_build.LazyLibrary(
        Path(__file__).with_name(source),
        FLAGS,
        declare,
        f"rollout: native {what}",
        "using the torch path on CPU (same results, slower).",
    )


attention = _library("cascade_decode.c", declare_attention, "decode attention")
prefill = _library("prefill_attention.c", declare_prefill, "prefill attention")
pointwise = _library("pointwise.c", declare_pointwise, "element-wise kernels")
sampling = _library("sampling.c", declare_sampling, "sampling")
transpose = _library("transpose.c", declare_transpose, "transposing copy")
small_gemm = _library("small_gemm.c", declare_small_gemm, "small-batch linear")


def transposed_target(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `transpose_copy_` applies: dst [R, C] a column-major view (each column's R
    elements contiguous, as `CausalLM.column_major` stores a weight), src [R, C] row-major (each
    row contiguous), the same 2-, 4- or 8-byte dtype, both on the CPU."""
    return (
        dst.dim() == 2
        and src.shape == dst.shape
        and src.dtype == dst.dtype
        and dst.element_size() in (2, 4, 8)
        and dst.device.type == src.device.type == "cpu"
        and dst.numel() > 0
        and dst.stride(0) == 1
        and dst.stride(1) >= dst.shape[0]
        and src.stride(1) == 1
        and src.stride(0) >= src.shape[1]
    )


def transpose_copy_(lib: ctypes.CDLL, dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src) for a column-major dst and a row-major src (`transposed_target`): the
    same bytes, moved in cache-sized blocks instead of torch's element-wise strided walk."""
    assert transposed_target(dst, src), (dst.shape, dst.stride(), src.shape, src.stride())
    status = lib.transpose_copy(
        src.data_ptr(), src.stride(0), dst.data_ptr(), dst.stride(1), dst.shape[0],
        dst.shape[1], dst.element_size(), torch.get_num_threads(),
    )  # fmt: skip
    assert status == 0, status


STREAM_COPY_BYTES = 1 << 20  # smaller copies stay in cache: the ordinary copy is as good


def streamed_target(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `stream_copy_` applies: the same dtype, both contiguous on the CPU, at least
    `STREAM_COPY_BYTES`."""
    return (
        dst.device.type == src.device.type == "cpu"
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.nbytes >= STREAM_COPY_BYTES
        and dst.is_contiguous()
        and src.is_contiguous()
    )


def stream_copy_(lib: ctypes.CDLL, dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src), bitwise, with streaming stores (`streamed_target` must hold)."""
    assert streamed_target(dst, src), (dst.shape, dst.dtype, src.shape, src.dtype)
    lib.stream_copy(src.data_ptr(), dst.data_ptr(), dst.nbytes)


def _rows_of_dh(t: torch.Tensor) -> torch.Tensor:
    """`t` [..., L, Dh] with rows of Dh contiguous floats, one after another (a view if it has)."""
    return t if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1] else t.contiguous()


def cascade_decode(
    lib: ctypes.CDLL,
    grid_q: torch.Tensor,
    suffix_kv: tuple[torch.Tensor, torch.Tensor],
    suffix_bias: torch.Tensor,
    prefix_kv: tuple[torch.Tensor, torch.Tensor] | None,
    prefix_bias: torch.Tensor,
    group_of: torch.Tensor,
) -> torch.Tensor:
    """Softmax attention of each sequence's grid rows over (its group's prefix ++ its suffix).

    K and V float32, or all bfloat16 (read as stored, widened exactly on load; float32
    arithmetic either way; a mix is widened to float32 first). grid_q [D, Hkv, R, Dh] float32,
    rows ordered (query token, head in the KV group), read in
    place where each sequence's Hkv * R rows are contiguous, whatever the stride between
    sequences (the q heads of the fused projection's output); suffix K, V [Hkv, D, Ls, Dh];
    suffix_bias [D, Q, Ls] additive (row r reads query r // (R / Q)); prefix K, V
    [Hkv, G, Lp, Dh] or None; prefix_bias [G, Lp]; group_of [D] -> [D, Hkv, R, Dh], contiguous."""
    num_seqs, num_kv_heads, rows, head_dim = grid_q.shape
    if grid_q.stride()[1:] != (rows * head_dim, head_dim, 1):
        grid_q = grid_q.contiguous()
    kv = (*suffix_kv, *(prefix_kv or ()))
    bf16 = all(t.dtype == torch.bfloat16 for t in kv)
    if not bf16 and any(t.dtype != torch.float32 for t in kv):
        suffix_kv = tuple(t.to(torch.float32) for t in suffix_kv)
        prefix_kv = None if prefix_kv is None else tuple(t.to(torch.float32) for t in prefix_kv)
    suffix_k, suffix_v = (_rows_of_dh(t) for t in suffix_kv)
    if suffix_k.stride() != suffix_v.stride():
        suffix_k, suffix_v = suffix_k.contiguous(), suffix_v.contiguous()
    suffix_bias = suffix_bias.to(torch.float32).contiguous()
    rows_per_bias = rows // suffix_bias.shape[1]
    if prefix_kv is None:
        prefix_k = prefix_v = prefix_bias = suffix_k  # not read: Lp = 0
        prefix_len = 0
    else:
        prefix_k, prefix_v = (t.contiguous() for t in prefix_kv)
        prefix_bias = prefix_bias.to(torch.float32).contiguous()
        prefix_len = prefix_k.shape[2]
        assert prefix_bias.shape[1] == prefix_len, (prefix_bias.shape, prefix_k.shape)
    group_of = group_of.to(torch.int64).contiguous()
    out = torch.empty(grid_q.shape, dtype=torch.float32)
    kernel = lib.cascade_decode_bf16 if bf16 else lib.cascade_decode_f32
    status = kernel(
        num_seqs,
        num_kv_heads,
        rows,
        head_dim,
        rows_per_bias,
        grid_q.data_ptr(),
        grid_q.stride(0),
        suffix_k.data_ptr(),
        suffix_v.data_ptr(),
        suffix_k.stride(0),
        suffix_k.stride(1),
        suffix_k.shape[2],
        suffix_bias.data_ptr(),
        prefix_k.data_ptr(),
        prefix_v.data_ptr(),
        prefix_k.stride(0),
        prefix_k.stride(1) if prefix_len else 0,
        prefix_len,
        prefix_bias.data_ptr(),
        group_of.data_ptr(),
        prefix_k.shape[1] if prefix_len else 0,
        1.0 / math.sqrt(head_dim),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if status == -2:
        raise IndexError("cascade decode attention: a sequence's group is out of range")
    if status != 0:
        raise MemoryError("cascade decode attention: a score buffer could not be allocated")
    return out


POINTWISE_DTYPES = (torch.float32, torch.bfloat16)  # the element-wise kernels' dtypes
PREFILL_DTYPES = POINTWISE_DTYPES  # the prefill attention kernel's


def _heads_of_dh(t: torch.Tensor) -> torch.Tensor:
    """`t` [..., heads, Dh] with each token's heads one contiguous run (a view if it has)."""
    if t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]:
        return t
    return t.contiguous()


def prefill_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
) -> None:
    """Causal attention of `count` chunks into `out` (written in place):
    `F.scaled_dot_product_attention(q, k, v, attn_mask=causal lower-right, enable_gqa=True)`
    per chunk, with softmax and products in float32. bfloat16 inputs on a CPU with AMX-BF16
    (head dims a multiple of 32, up to 128): the products on AMX tiles and the probabilities
    rounded to bfloat16 before P V, as torch's bfloat16 SDPA rounds them
    (`lib.prefill_attention_has_amx()` says whether this build and process can).

    q, out [count, n, H, Dh]; k, v [count, Hkv, C, Dh] (C >= n: query i sees keys
    <= C - n + i), all float32 or all bfloat16, each row of Dh elements contiguous, any chunk,
    token and head strides for K / V; q's and out's heads of a token one contiguous run (the
    q heads of the fused projection's output are read in place)."""
    count, n, num_heads, head_dim = q.shape
    num_kv_heads, context = k.shape[1], k.shape[2]
    assert q.dtype == k.dtype == v.dtype == out.dtype and q.dtype in PREFILL_DTYPES, q.dtype
    assert out.shape == q.shape and k.shape == v.shape, (q.shape, out.shape, k.shape, v.shape)
    assert context >= n and num_heads % num_kv_heads == 0, (q.shape, k.shape)
    q = _heads_of_dh(q)
    assert out.stride()[2:] == (head_dim, 1), out.stride()
    if k.stride() != v.stride() or k.stride(-1) != 1:
        k, v = k.contiguous(), v.contiguous()
    if not count or not n:
        return
    status = lib.prefill_attention(
        count, n, context, num_heads, num_kv_heads, head_dim,
        q.data_ptr(), q.stride(0), q.stride(1),
        k.data_ptr(), v.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
        out.data_ptr(), out.stride(0), out.stride(1),
        1.0 / math.sqrt(head_dim), int(q.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    if status != 0:
        raise MemoryError("prefill attention: a buffer could not be allocated")


def _rows(t: torch.Tensor, what: str, dtypes=(torch.float32,)) -> int:
    """Token stride of a [T, ...] tensor of one of `dtypes` whose rows are each contiguous."""
    inner = t[0] if t.dim() > 1 and t.shape[0] > 0 else t
    assert t.dtype in dtypes and inner.is_contiguous(), (what, t.dtype, t.stride())
    return t.stride(0)


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rollout.model.RMSNorm` of x [T, H] float32 or bfloat16 (weight the same dtype) -> a new
    [T, H] tensor."""
    out = torch.empty(x.shape, dtype=x.dtype)
    if not x.shape[0]:
        return out
    stride, threads = _rows(x, "x", POINTWISE_DTYPES), torch.get_num_threads()
    weight = weight.to(x.dtype).contiguous()
    if x.dtype == torch.bfloat16:
        lib.rms_norm_bf16(
            x.data_ptr(), stride, weight.data_ptr(), eps, out.data_ptr(), out.stride(0),
            x.shape[0], x.shape[1], threads,
        )  # fmt: skip
    else:
        lib.rms_norm_f32(
            x.data_ptr(), stride, None, 0, weight.data_ptr(), eps, out.data_ptr(), out.stride(0),
            x.shape[0], x.shape[1], threads,
        )  # fmt: skip
    return out


def add_rms_norm_(
    lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += residual (in place: x becomes the residual stream), then `rms_norm` of it -> a new
    tensor: `residual + x` and the `rollout.model.RMSNorm` of the sum in one pass, for x,
    residual [T, H] of one dtype (float32 or bfloat16, rows contiguous)."""
    assert residual.shape == x.shape and residual.dtype == x.dtype, (residual.shape, x.shape)
    _rows(x, "x", POINTWISE_DTYPES), _rows(residual, "residual", POINTWISE_DTYPES)
    return add_rms_norm_unchecked_(lib, x, residual, weight.to(x.dtype).contiguous(), eps)


def rms_norm_unchecked(
    lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`rms_norm` for arguments already known to suit it (x [T, H] with contiguous rows, weight
    [H] contiguous of x's dtype, one of `POINTWISE_DTYPES`): the engine's per-layer calls, with
    no per-call checks."""
    out = torch.empty(x.shape, dtype=x.dtype)
    if x.dtype == torch.bfloat16:
        lib.rms_norm_bf16(
            x.data_ptr(), x.stride(0), weight.data_ptr(), eps, out.data_ptr(), x.shape[1],
            x.shape[0], x.shape[1], torch.get_num_threads(),
        )  # fmt: skip
    else:
        lib.rms_norm_f32(
            x.data_ptr(), x.stride(0), None, 0, weight.data_ptr(), eps, out.data_ptr(),
            x.shape[1], x.shape[0], x.shape[1], torch.get_num_threads(),
        )  # fmt: skip
    return out


def add_rms_norm_unchecked_(
    lib: ctypes.CDLL, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """`add_rms_norm_` for arguments already known to suit it (as `rms_norm_unchecked`;
    residual the same shape and dtype as x, rows contiguous)."""
    out = torch.empty(x.shape, dtype=x.dtype)
    kernel = lib.add_rms_norm_bf16 if x.dtype == torch.bfloat16 else lib.rms_norm_f32
    kernel(
        x.data_ptr(), x.stride(0), residual.data_ptr(), residual.stride(0), weight.data_ptr(),
        eps, out.data_ptr(), x.shape[1], x.shape[0], x.shape[1], torch.get_num_threads(),
    )  # fmt: skip
    return out


def rotary_(
    lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate x [T, heads, D] float32 or bfloat16 in place (`RotaryEmbedding.rotate`): heads of D
    contiguous elements, cos / sin [max_positions, D] float32 tables, positions [T] int64."""
    assert x.stride(1) == x.shape[2] and x.stride(2) == 1, x.stride()
    assert x.dtype in POINTWISE_DTYPES and cos.dtype == sin.dtype == torch.float32
    positions = positions.to(torch.int64).contiguous()
    assert cos.shape == sin.shape and cos.shape[1] == x.shape[2], (cos.shape, x.shape)
    kernel = lib.rotary_bf16 if x.dtype == torch.bfloat16 else lib.rotary_f32
    if x.shape[0] and kernel(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2],
        cos.contiguous().data_ptr(), sin.contiguous().data_ptr(), cos.shape[0],
        positions.data_ptr(), torch.get_num_threads(),
    ):  # fmt: skip
        raise IndexError(f"rotary: a position is outside the tables' {cos.shape[0]} rows")


def rotary_unchecked_(
    lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """`rotary_` for arguments already known to suit it (x's heads contiguous, cos / sin
    contiguous float32 tables of x's head dim, positions int64 contiguous); the kernel still
    refuses a position outside the tables."""
    kernel = lib.rotary_bf16 if x.dtype == torch.bfloat16 else lib.rotary_f32
    if kernel(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], x.shape[2], cos.data_ptr(),
        sin.data_ptr(), cos.shape[0], positions.data_ptr(), torch.get_num_threads(),
    ):  # fmt: skip
        raise IndexError(f"rotary: a position is outside the tables' {cos.shape[0]} rows")


def silu_mul_halves_unchecked(lib: ctypes.CDLL, gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` of the two halves of gate_up [T, 2 I] (the fused gate/up projection's output,
    rows contiguous, float32 or bfloat16), read in place, with no per-call checks -> [T, I]."""
    rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype)
    kernel = lib.silu_mul_bf16 if gate_up.dtype == torch.bfloat16 else lib.silu_mul_f32
    gate, stride = gate_up.data_ptr(), gate_up.stride(0)
    kernel(
        gate, stride, gate + width * gate_up.element_size(), stride, out.data_ptr(), width, rows,
        width, torch.get_num_threads(),
    )  # fmt: skip
    return out


def silu_mul(lib: ctypes.CDLL, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [T, I] float32 or bfloat16 (rows contiguous) -> a new [T, I]
    tensor."""
    dtypes = (torch.float32, torch.bfloat16)
    out = torch.empty(gate.shape, dtype=gate.dtype)
    kernel = lib.silu_mul_bf16 if gate.dtype == torch.bfloat16 else lib.silu_mul_f32
    assert up.dtype == gate.dtype, (gate.dtype, up.dtype)
    if gate.shape[0]:
        kernel(
            gate.data_ptr(), _rows(gate, "gate", dtypes), up.data_ptr(), _rows(up, "up", dtypes),
            out.data_ptr(), out.stride(0), gate.shape[0], gate.shape[1], torch.get_num_threads(),
        )  # fmt: skip
    return out


def scatter_rows_(
    lib: ctypes.CDLL, dst: torch.Tensor, index: torch.Tensor, src: torch.Tensor
) -> None:
    """dst[h, index[t]] = src[t, h] for dst [Hkv, N, D] (rows of D contiguous elements, any head
    stride) and src [T, Hkv, D], both float32 or both bfloat16:
    `dst.index_copy_(1, index, src.transpose(0, 1))`."""
    num_tokens, num_kv_heads, head_dim = src.shape
    assert dst.dtype == src.dtype and src.dtype in POINTWISE_DTYPES, (dst.dtype, src.dtype)
    assert dst.stride(1) == head_dim and dst.stride(2) == 1, dst.stride()
    assert src.stride(1) == head_dim and src.stride(2) == 1, src.stride()
    assert index.dtype == torch.int64 and index.is_contiguous() and index.numel() == num_tokens
    kernel = lib.scatter_rows_16 if src.dtype == torch.bfloat16 else lib.scatter_rows_f32
    if num_tokens and kernel(
        dst.data_ptr(), dst.stride(0), dst.shape[1], src.data_ptr(), src.stride(0),
        index.data_ptr(), num_tokens, num_kv_heads, head_dim, torch.get_num_threads(),
    ):  # fmt: skip
        raise IndexError(f"K/V store: a row index is outside [0, {dst.shape[1]})")


def scatter_kv_rows_(
    lib: ctypes.CDLL,
    dst_k: torch.Tensor,
    dst_v: torch.Tensor,
    index: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """`scatter_rows_(lib, dst_k, index, k)` and `scatter_rows_(lib, dst_v, index, v)` in one
    call, for dst_k, dst_v of one shape and strides and k, v of one shape and strides (a layer's
    K and V of the pool or the lanes; k, v views of one projection's output)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert dst_k.dtype == dst_v.dtype == k.dtype == v.dtype and k.dtype in POINTWISE_DTYPES
    assert dst_k.shape == dst_v.shape and dst_k.stride() == dst_v.stride(), (dst_k, dst_v)
    assert k.shape == v.shape and k.stride() == v.stride(), (k.stride(), v.stride())
    assert dst_k.stride(1) == head_dim and dst_k.stride(2) == 1, dst_k.stride()
    assert k.stride(1) == head_dim and k.stride(2) == 1, k.stride()
    assert index.dtype == torch.int64 and index.is_contiguous() and index.numel() == num_tokens
    size = k.element_size()
    if num_tokens and lib.scatter_kv_rows(
        dst_k.data_ptr(), dst_v.data_ptr(), dst_k.stride(0) * size, dst_k.shape[1],
        k.data_ptr(), v.data_ptr(), k.stride(0) * size, index.data_ptr(), num_tokens,
        num_kv_heads, head_dim * size, torch.get_num_threads(),
    ):  # fmt: skip
        raise IndexError(f"K/V store: a row index is outside [0, {dst_k.shape[1]})")


def sample_rows(
    lib: ctypes.CDLL, logits: torch.Tensor, temperature: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rollout.sampler.sample` for rows without truncation and with temperature > 0: logits
    [R, V] float32 (rows contiguous), temperature [R], uniforms [R] -> (tokens [R] int64,
    logprobs [R] float32)."""
    num_rows, vocab = logits.shape
    stride = _rows(logits, "logits")
    temperature = temperature.to(torch.float32).contiguous()
    uniforms = uniforms.to(torch.float64).contiguous()
    assert temperature.shape == uniforms.shape == (num_rows,)
    tokens = torch.empty(num_rows, dtype=torch.int64)
    logprobs = torch.empty(num_rows, dtype=torch.float32)
    scratch = torch.empty(num_rows, vocab, dtype=torch.float32)
    if num_rows:
        lib.sample_rows_f32(
            logits.data_ptr(), stride, num_rows, vocab, temperature.data_ptr(),
            uniforms.data_ptr(), scratch.data_ptr(), tokens.data_ptr(), logprobs.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
    return tokens, logprobs


def small_linear_target(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `small_linear` takes x [M, K] and weight [N, K] as they are: both float32 or both
    bfloat16 on the CPU, each row of x and each output's weights contiguous."""
    return (
        x.dim() == 2
        and weight.dim() == 2
        and x.dtype == weight.dtype
        and x.dtype in POINTWISE_DTYPES
        and x.device.type == weight.device.type == "cpu"
        and x.shape[1] == weight.shape[1]
        and (x.stride(1) == 1 or x.shape[1] == 1)
        and (weight.stride(1) == 1 or weight.shape[1] == 1)
    )


def small_linear(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` (+ residual: `residual + F.linear(...)`, in float32 one
    `addmm(residual, x, weight.t())`) for x [M, K], weight [N, K] as `small_linear_target`
    says, bias [N], residual [M, N] of the same dtype -> a new [M, N] tensor. float32 sums in
    another order than torch's; bfloat16 rounds the float32 sum (+ bias) once, then again after
    the residual add, as torch's ops round (on AMX tiles where `lib.small_gemm_has_amx()`: the
    same function, another summation order)."""
    assert small_linear_target(x, weight), (x.shape, x.stride(), weight.shape, weight.stride())
    return small_linear_unchecked(lib, x, weight, *_small_linear_extras(x, weight, bias, residual))


def small_linear_unchecked(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """`small_linear` for arguments already known to suit it (bias contiguous, residual rows
    contiguous): the per-call work of the engine's decode steps, kept to the call itself."""
    rows, outs = x.shape[0], weight.shape[0]
    out = torch.empty(rows, outs, dtype=x.dtype)
    lib.small_gemm(
        rows, outs, x.shape[1], x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
        None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), out.data_ptr(), outs,
        x.dtype == torch.bfloat16, torch.get_num_threads(),
    )  # fmt: skip
    return out


# The input transforms of `small_linear_prepared_unchecked` (small_gemm.c's PREPARE_*).
PREPARE_RMS_NORM, PREPARE_SILU_MUL = 1, 2


def small_linear_prepared_unchecked(
    lib: ctypes.CDLL,
    prepare: int,
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """`small_linear_unchecked` (bfloat16) of a transform of x, in one call and one pass over x:
    PREPARE_RMS_NORM, `rms_norm` of x [M, K] (norm_weight [K] contiguous bfloat16, eps);
    PREPARE_SILU_MUL, `silu_mul_halves_unchecked` of x [M, 2 K]. Bitwise the separate element-wise
    kernel then `small_linear_unchecked` (the same row code, `bf16_rows.h`), for arguments known to
    suit both (rows of x contiguous, weight [N, K] as `small_linear_target` says)."""
    rows, outs = x.shape[0], weight.shape[0]
    out = torch.empty(rows, outs, dtype=x.dtype)
    if lib.small_gemm_prepared(
        rows, outs, weight.shape[1], prepare, x.data_ptr(), x.stride(0),
        None if norm_weight is None else norm_weight.data_ptr(), eps, weight.data_ptr(),
        weight.stride(0), None if bias is None else bias.data_ptr(),
        None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), out.data_ptr(), outs,
        torch.get_num_threads(),
    ):  # fmt: skip
        raise MemoryError("small_gemm_prepared: no memory for the transformed rows")
    return out


def small_linear_rms_norm(
    lib: ctypes.CDLL,
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`small_linear(lib, rms_norm(x, norm_weight, eps), weight, bias, residual)` for bfloat16
    x [M, K] (rows contiguous) in one call, bitwise."""
    assert x.dtype == torch.bfloat16 and small_linear_target(x, weight), (x.dtype, x.shape)
    assert norm_weight.shape == (x.shape[1],), norm_weight.shape
    return small_linear_prepared_unchecked(
        lib, PREPARE_RMS_NORM, x, norm_weight.to(x.dtype).contiguous(), eps, weight,
        *_small_linear_extras(x, weight, bias, residual),
    )  # fmt: skip


def small_linear_silu_mul(
    lib: ctypes.CDLL,
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """`small_linear(lib, silu_mul_halves(gate_up), weight, bias, residual)` for bfloat16
    gate_up [M, 2 K] (rows contiguous) in one call, bitwise."""
    inner = weight.shape[1]
    assert gate_up.dtype == torch.bfloat16 and gate_up.dim() == 2, gate_up.dtype
    assert gate_up.shape[1] == 2 * inner and gate_up.stride(1) == 1, (gate_up.shape, inner)
    assert weight.dtype == gate_up.dtype and (weight.stride(1) == 1 or inner == 1), weight.stride()
    return small_linear_prepared_unchecked(
        lib, PREPARE_SILU_MUL, gate_up, None, 0.0, weight,
        *_small_linear_extras(gate_up[:, :inner], weight, bias, residual),
    )  # fmt: skip


def _small_linear_extras(x, weight, bias, residual):
    """(bias, residual) checked and laid out as `small_linear` takes them."""
    outs = weight.shape[0]
    if bias is not None:
        assert bias.shape == (outs,) and bias.dtype == x.dtype, (bias.shape, bias.dtype)
        bias = bias.contiguous()
    if residual is not None:
        assert residual.shape == (x.shape[0], outs) and residual.dtype == x.dtype, residual.shape
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    return bias, residual
