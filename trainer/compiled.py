"""`torch.compile` of the megatron trainer's element-wise pieces (`TrainerConfig.compile`).

Eagerly, each RMSNorm (square, mean, add, rsqrt, two multiplies) and each SwiGLU (chunk, silu,
add of megatron's zero `glu_linear_offset`, multiply; in the backward silu's derivative, three
multiplies and a concatenation of the two halves' gradients) is a chain of separate passes over
[tokens, width] activations, and autograd records every intermediate. Compiled, inductor fuses
each chain into one loop per direction (C++ / OpenMP on CPU, Triton on GPU); the matrix
multiplies, attention and the loss stay as they are.

* RMSNorm: every `torch.nn.RMSNorm` of the model (megatron's `WrappedTorchNorm`) calls one
  compiled `F.rms_norm` on its input viewed as [rows, width]; all norms share it (weight and
  eps are its inputs). A strided input (q/k-norms of head views) stays eager.
* Rotary (packed sequences): `packed_rope`'s rotation and its transpose as one compiled
  expression each (`packed_rope.rotation_of`), for the models marked by `mark_rotary`.
* SwiGLU: megatron's own fused path (`bias_activation_fusion`: `SwiGLUFunction`, whose forward
  and hand-written backward megatron wraps in `torch.compile`), switched on in
  `megatron_model.transformer_config`; `compile_swiglu` re-wraps the same two functions with
  a dynamic token dimension (megatron's default wrapping specialises on the first length and
  recompiles on the second, inside a timed step of a mixed-length run). Only models built
  with `compile` take this path: an eager model runs megatron's unfused SwiGLU.

Shapes: the norm and the rotation are compiled with a dynamic token dimension, so a run
compiles each once per dtype, grad mode (a no-grad scoring pass, a training forward, the
rotation's backward) and input layout, for any micro-batch length (dynamo specialises sizes 0
and 1), and so do the SwiGLU pieces.
Inductor caches compiled code on disk, so a later process with the same shapes compiles faster
(cold vs warm: benchmarks/RESULTS.md).

The eager model is the reference: compiled code rounds differently (fused reductions, a
vectorised sigmoid), so log-probs, loss and gradients agree within a float32 bound, not
bitwise (tests/trainer/test_trainer_compiled.py). The on-policy first update's PPO-KL stays
exactly 0 (its old log-probs are this forward's own, compiled or not).
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


_compiled_rms_norm = None
# Compiled variants a piece may need: dtypes x grad modes x norm widths x the rotation's input
# layouts (query / key views of the fused QKV output, their gradients). Dynamo's default of 8
# per function is global; it is raised only around calls of these pieces.
_VARIANTS = 32


def call(fn, *args):
    """`fn(*args)` for a compiled piece, allowed up to `_VARIANTS` recompiles."""
    with torch._dynamo.config.patch(recompile_limit=_VARIANTS):
        return fn(*args)


def _norm_forward(norm: torch.nn.RMSNorm):
    global _compiled_rms_norm
    if _compiled_rms_norm is None:
        _compiled_rms_norm = torch.compile(_rms_norm, dynamic=True, fullgraph=True)
    eps = norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():  # q/k-norms of strided head views: eager (no extra copy)
            return F.rms_norm(x, norm.weight.shape, norm.weight, eps)
        # one 2-D shape for every norm: [rows, width], rows dynamic
        out = call(_compiled_rms_norm, x.view(-1, x.shape[-1]), norm.weight, eps)
        return out.view(x.shape)

    return forward


def compile_norms(model: torch.nn.Module) -> int:
    """Route every RMSNorm of `model` through the compiled norm (in place; idempotent).
    Returns how many norms it routed."""
    count = 0
    for module in model.modules():
        if isinstance(module, torch.nn.RMSNorm) and not getattr(module, "_compiled", False):
            if module.weight is None:
                raise ValueError("TrainerConfig.compile needs RMSNorms with a weight")
            module.forward = _norm_forward(module)
            module._compiled = True
            count += 1
    return count


# a TransformerConfig attribute: the rotary path sees the layer's config, not the model
_ROTARY_FLAG = "miles_like_compiled_rotary"


def mark_rotary(config) -> None:
    """Have the packed rotary embedding of layers built with `config` run compiled."""
    setattr(config, _ROTARY_FLAG, True)


def rotary_marked(config) -> bool:
    """Whether `mark_rotary` marked `config` (`packed_rope.rotation_of` then compiles)."""
    return getattr(config, _ROTARY_FLAG, False)


def compile_swiglu() -> None:
    """Megatron's SwiGLU forward / backward functions, compiled with a dynamic token dimension
    (in place of megatron's own `torch.compile` wrapping; idempotent)."""
    from megatron.core.fusions import fused_bias_swiglu as fused

    for name in ("swiglu", "swiglu_back"):
        fn = getattr(fused, name)
        if getattr(fn, "_miles_like_dynamic", False):
            continue
        # megatron's function, unwrapped from its torch.compile (or compile_on_first_call)
        eager = getattr(fn, "_torchdynamo_orig_callable", None) or inspect.unwrap(fn)
        dynamic = torch.compile(eager, dynamic=True)
        dynamic._miles_like_dynamic = True
        setattr(fused, name, dynamic)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (all compiled functions together)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
