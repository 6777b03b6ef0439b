"""Run the Triton kernels on CPU through the Triton interpreter.

Triton decides between compiling and interpreting when a kernel is *decorated*, i.e. when
`rollout.kernels` is imported, and the interpreter also reads TRITON_INTERPRET while running
(lazy imports check it), so the variable is set here, for the whole process, before any kernel
test imports the kernels. Nothing else in the test suite runs Triton kernels on CPU, so the
setting changes nothing for other tests. If some earlier test module already imported
`rollout.kernels` compiled (say, through the engine), its modules are reloaded interpreted.

No skip: without triton or its interpreter, the kernel test modules fail at import.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

_KERNEL_MODULES = (
    "rollout.kernels.kv_store",
    "rollout.kernels.decode_attention",
    "rollout.kernels.triton_attention",
    "rollout.kernels",
)
if (
    "rollout.kernels.decode_attention" in sys.modules
    and not sys.modules["rollout.kernels.decode_attention"].INTERPRETED
):
    for _name in _KERNEL_MODULES:
        importlib.reload(sys.modules[_name])
