"""Import megatron-core without paying torch.compile's import cost at import time.

megatron-core decorates its fusion functions (bias-GeLU / SwiGLU / GeGLU, activations, norms,
MoE helpers) with `megatron.core.jit.jit_fuser`, which is `torch.compile`. Calling
`torch.compile(fn)` imports dynamo and inductor, seconds of CPU in every trainer process,
although a trainer calls few or none of those functions. `import_megatron_core()` imports
megatron-core with `jit_fuser` bound to `compile_on_first_call`: the same `torch.compile` with
the same options, applied when the function is first called instead of when it is defined, so
a function that runs is compiled exactly as before and one that never runs costs nothing.

Call it before anything else imports megatron (`make_trainer`, the trainer ranks' start-up);
once megatron.core is imported it does nothing.
"""

from __future__ import annotations

import functools
import sys

import torch

_torch_compile = torch.compile  # the real one, whatever is patched during the import


def compile_on_first_call(fn=None, **options):
    """`torch.compile(fn, **options)`, evaluated at `fn`'s first call. Works as `@decorator`,
    `@decorator(**options)` and `decorator(fn)`, as `torch.compile` does; the wrapper's
    `__wrapped__` is `fn`."""
    if fn is None:
        return functools.partial(compile_on_first_call, **options)
    compiled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = _torch_compile(fn, **options)
        return compiled(*args, **kwargs)

    return call


def import_megatron_core() -> None:
    """Import megatron.core with `jit_fuser` compiling on first call (idempotent)."""
    if "megatron.core" in sys.modules:
        return
    torch.compile = compile_on_first_call  # read by megatron.core.jit as it is imported
    try:
        import megatron.core  # noqa: F401
    finally:
        torch.compile = _torch_compile
