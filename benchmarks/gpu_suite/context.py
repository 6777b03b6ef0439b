"""What a section's function gets: where it runs, a shared work folder, and the check recorder.

A section calls `ctx.check(name, ok, **figures)` for every exactness check and `ctx.note(**)`
for figures worth keeping even if it dies later: both rewrite the result file at once, so a
section killed at its budget still reports the checks it had made.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class Context:
    def __init__(self, result_path: Path, workdir: Path, dry_run: bool, timeout_s: float):
        self.result_path = result_path
        self.workdir = workdir
        self.dry_run = dry_run
        self.timeout_s = timeout_s
        self.checks: list[dict[str, Any]] = []
        self.partial: dict[str, Any] = {}

    @classmethod
    def from_env(cls) -> Context:
        return cls(
            Path(os.environ["GPU_SUITE_RESULT"]),
            Path(os.environ.get("GPU_SUITE_WORKDIR", "/tmp")),
            os.environ.get("GPU_SUITE_DRY_RUN") == "1",
            float(os.environ.get("GPU_SUITE_TIMEOUT_S", "300")),
        )

    @property
    def device(self) -> str:
        """cuda on the GPU machine; cpu in the dry run."""
        return "cpu" if self.dry_run else "cuda"

    @property
    def cuda(self) -> bool:
        return not self.dry_run

    def check(self, name: str, ok: bool, **figures: Any) -> bool:
        """Record one exactness check (its figures: what was compared, and the bound)."""
        self.checks.append({"name": name, "ok": bool(ok), **figures})
        self._write({"checks": self.checks, "partial": self.partial})
        return bool(ok)

    def note(self, **values: Any) -> None:
        self.partial.update(values)
        self._write({"checks": self.checks, "partial": self.partial})

    def finish(self, result: dict[str, Any] | None) -> None:
        self._write({"checks": self.checks, "result": {**self.partial, **(result or {})}})

    def fail(self, error: str, traceback_text: str) -> None:
        self._write(
            {
                "checks": self.checks,
                "partial": self.partial,
                "error": error,
                "traceback": traceback_text,
            }
        )

    def _write(self, payload: dict[str, Any]) -> None:
        # Replaced atomically: the harness may read it after a kill at any moment.
        tmp = self.result_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(payload, default=_plain))
        os.replace(tmp, self.result_path)


def _plain(value: Any) -> Any:
    """Tensors, numpy scalars and the like as plain JSON values."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if hasattr(value, "_asdict"):
        return value._asdict()
    return str(value)
