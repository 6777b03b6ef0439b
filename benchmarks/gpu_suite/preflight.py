"""The preflight's process: `python -m benchmarks.gpu_suite.preflight MODULE ...`.

Imports each module on its own (a failure is recorded, not fatal: the harness skips the sections
that need it, with this error as the reason) and reads the machine: Python, package versions, the
device. Writes {"env": {...}, "imports": {module: None | "Type: message"}} to the result file.
"""

from __future__ import annotations

import importlib
import json
import os
import platform
import sys
from importlib import metadata

DISTRIBUTIONS = ("torch", "triton", "transformers", "megatron-core", "safetensors", "numpy")


def import_error(module: str) -> str | None:
    try:
        if module.startswith(("megatron", "trainer.megatron")):
            # as the trainer imports it (torch.compile deferred to first call)
            from trainer.megatron_import import import_megatron_core

            import_megatron_core()
        importlib.import_module(module)
    except BaseException as e:  # noqa: BLE001 - any failure to import is the reason to skip
        return f"{type(e).__name__}: {e}"
    return None


def environment() -> dict:
    env: dict = {
        "python": platform.python_version(),
        "versions": {},
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
    }
    for dist in DISTRIBUTIONS:
        try:
            env["versions"][dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            env["versions"][dist] = None
    import torch

    env["cuda"] = torch.cuda.is_available()
    env["device_count"] = torch.cuda.device_count() if env["cuda"] else 0
    if env["cuda"]:
        props = torch.cuda.get_device_properties(0)
        env.update(
            device=torch.cuda.get_device_name(0),
            device_memory_gib=round(props.total_memory / 2**30, 1),
            multiprocessors=props.multi_processor_count,
            cuda_runtime=torch.version.cuda,
        )
    else:
        env["device"] = "cpu"
    return env


def main(modules: list[str]) -> int:
    result = {"env": environment(), "imports": {m: import_error(m) for m in modules}}
    with open(os.environ["GPU_SUITE_RESULT"], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
