"""Rotary position embedding of packed (`thd`) sequences, in place of megatron-core's.

megatron-core 0.16.1's unfused `thd` path, run by every attention layer for its query and its
key, slices the frequencies per sequence and concatenates them, takes their cos / sin, applies
`t * cos + rotate_half(t) * sin` through a slice, a negation and two concatenations (one of them
of `t` with an empty pass-through part), and autograd records every one of those copies for the
backward. Here the packed rows' cos / sin are computed once per micro-batch (every layer gets
the same frequency and `cu_seqlens` tensors) and one autograd function applies the rotation to
each half directly, its backward being the transposed rotation:

    out_1 = x_1 c_1 - x_2 s_1          grad_1 = g_1 c_1 + g_2 s_2
    out_2 = x_2 c_2 + x_1 s_2          grad_2 = g_2 c_2 - g_1 s_1

Each product and sum is the one megatron's formula computes (negation is exact, addition
commutes), so values and gradients are bitwise megatron's. Anything else (unpacked `bshd`,
context parallelism, interleaved or partial rotary, MLA, a yarn `mscale`) goes to megatron's
own function unchanged.

`install()` swaps the name `apply_rotary_pos_emb` in `megatron.core.transformer.attention`,
the one caller the trainer's attention layers use; it is idempotent.
"""

from __future__ import annotations

import torch

from trainer import compiled, shared_prompts
from trainer.compiled import call

_original = None
_compiled_rotation = None
# ((freqs, its version, cu_seqlens, its version, dtype), (cos, sin) [t, 1, d]) of the packed
# micro-batch being computed; holding the tensors keeps their identities from being reused
_last: tuple | None = None


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, sin, fused):
        ctx.save_for_backward(cos, sin)
        ctx.fused = fused
        return _rotate(x, cos, sin, 1.0) if fused is None else call(fused, x, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.fused is None:
            return _rotate(grad, cos, sin, -1.0), None, None, None
        return call(ctx.fused, grad, cos, sin, -1.0), None, None, None


def _rotate(x, cos, sin, sign: float):
    """sign 1: out_1 = x_1 c_1 - x_2 s_1, out_2 = x_2 c_2 + x_1 s_2 (the rotation);
    sign -1: out_1 = x_1 c_1 + x_2 s_2, out_2 = x_2 c_2 - x_1 s_1 (its transpose)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    out = torch.empty_like(x)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, c1, out=o1)
    torch.mul(x2, c2, out=o2)
    if sign > 0:
        o1.sub_(x2 * s1)
        o2.add_(x1 * s2)
    else:
        o1.add_(x2 * s2)
        o2.sub_(x1 * s1)
    return out


def rotate_fused(x, cos, sin, sign: float):
    """`_rotate` as one expression, for `torch.compile` (`trainer.compiled`): one fused loop,
    whose rounding may differ from `_rotate`'s (fused multiply-adds)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if sign > 0:
        return torch.cat((x1 * c1 - x2 * s1, x2 * c2 + x1 * s2), dim=-1)
    return torch.cat((x1 * c1 + x2 * s2, x2 * c2 - x1 * s1), dim=-1)


def rotation_of(config):
    """`rotate_fused` compiled (one for every model) for a config marked by
    `compiled.mark_rotary`, else None (eager)."""
    global _compiled_rotation
    if not compiled.rotary_marked(config):
        return None
    if _compiled_rotation is None:
        _compiled_rotation = torch.compile(rotate_fused, dynamic=True, fullgraph=True)
    return _compiled_rotation


def _cos_sin(freqs: torch.Tensor, cu_seqlens: torch.Tensor, dtype: torch.dtype, total: int):
    """cos / sin of every packed row's position; `total` rows (`cu_seqlens[-1]`, which the
    caller knows from its tensor's shape: reading it from the device would sync the host)."""
    global _last
    if _last is not None:
        f, f_version, cu, cu_version, cached_dtype = _last[0]
        if (
            f is freqs
            and cu is cu_seqlens
            and (f_version, cu_version, cached_dtype)
            == (freqs._version, cu_seqlens._version, dtype)
        ):
            return _last[1]
    layout = shared_prompts.layout_for(cu_seqlens)
    if layout is not None:  # a response after a shared prompt continues the prompt's positions
        positions = layout.positions.to(freqs.device)
    else:
        bounds = cu_seqlens.to(torch.int64)
        lengths = bounds[1:] - bounds[:-1]
        rows = torch.arange(total, device=freqs.device)
        starts = torch.repeat_interleave(bounds[:-1], lengths, output_size=total)
        starts = starts.to(freqs.device)
        positions = rows - starts  # each row's position within its own sequence
    packed = freqs.reshape(freqs.shape[0], -1).index_select(0, positions).unsqueeze(1)
    # as megatron computes them: (cos(freqs) * mscale).to(t.dtype), here with mscale 1
    pair = (torch.cos(packed).to(dtype), torch.sin(packed).to(dtype))
    _last = ((freqs, freqs._version, cu_seqlens, cu_seqlens._version, dtype), pair)
    return pair


def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale: float = 1.0, cp_group=None):
    """megatron's `apply_rotary_pos_emb`, with packed sequences handled here (module doc)."""
    simple = (
        cu_seqlens is not None
        and not config.apply_rope_fusion
        and not config.rotary_interleaved
        and not config.multi_latent_attention
        and mscale == 1.0
        and (cp_group is None or cp_group.size() == 1)
        and t.dim() == 3
        and freqs.shape[-1] == t.shape[-1]
        and t.shape[-1] % 2 == 0
    )
    if not simple:
        if shared_prompts.layout_for(cu_seqlens) is not None:
            raise NotImplementedError(
                "shared prompts need the plain rotary embedding (no rope fusion, interleaving, "
                "MLA, mscale or context parallelism); set trainer.share_prompts: false"
            )
        return _original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
    cos, sin = _cos_sin(freqs, cu_seqlens, t.dtype, t.shape[0])
    return _Rotate.apply(t, cos, sin, rotation_of(config))


def install() -> None:
    global _original
    from megatron.core.transformer import attention

    if attention.apply_rotary_pos_emb is not apply_rotary_pos_emb:
        _original = attention.apply_rotary_pos_emb
        attention.apply_rotary_pos_emb = apply_rotary_pos_emb
