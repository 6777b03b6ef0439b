"""What a benchmark run leaves behind: its result with the date, the machine, the load average
and the exact command, as one JSON file (`--out PATH`, or `--save` for
`benchmarks/results/<benchmark>.json`). `benchmarks/results_table.py` renders RESULTS.md's table
of current figures from these files, so a figure there is never typed by hand.

A benchmark calls `add_output_args(parser)`, `record = RunRecord.start(name)` before it measures
(the load average at the start is the one that says whether the box was quiet), and
`record.finish(result, args)` at the end; its stdout stays the result alone, as before.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "benchmarks" / "results"


def add_output_args(parser: argparse.ArgumentParser) -> None:
    """`--out PATH` and `--save`: where the run's record goes (nowhere by default)."""
    group = parser.add_argument_group("result file")
    group.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the result with its date, machine, load average and command to this JSON file",
    )
    group.add_argument(
        "--save",
        action="store_true",
        help="the same, to benchmarks/results/<benchmark>.json (the file RESULTS.md's table reads)",
    )


def _first_line(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _gpus() -> list[str]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """The hardware and software a figure was measured on (nothing here imports torch)."""
    mem_kb = _first_line("/proc/meminfo", "MemTotal")
    return {
        "cpu": _first_line("/proc/cpuinfo", "model name") or platform.processor() or None,
        "arch": platform.machine(),
        "cores": os.cpu_count(),
        "memory_gib": round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None,
        "gpus": _gpus(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "transformers": _version("transformers"),
    }


# settings from the environment that change a figure (threads, devices, the C kernels)
ENV_KEYS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "MILES_LIKE_NATIVE")


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class RunRecord:
    """A benchmark run in progress: what was known when it started."""

    benchmark: str
    started: str
    load_avg_start: tuple[float, float, float]
    command: str

    @classmethod
    def start(
        cls, benchmark: str, argv: list[str] | None = None, script: str | None = None
    ) -> RunRecord:
        """`argv`: the arguments after the script (default `sys.argv[1:]`); `script`: how the
        run was started (default `benchmarks/<benchmark>.py`)."""
        argv = sys.argv[1:] if argv is None else list(argv)
        script = script or f"benchmarks/{benchmark}.py"
        return cls(
            benchmark=benchmark,
            started=_now(),
            load_avg_start=os.getloadavg(),
            command=shlex.join(["python", script, *argv]),
        )

    def document(self, result: dict) -> dict:
        """The JSON object written for this run, `result` as the benchmark printed it."""
        status = _git("status", "--porcelain", "--untracked-files=no")
        return {
            "benchmark": self.benchmark,
            "date": self.started,
            "finished": _now(),
            "machine": machine(),
            "load_avg": {"start": list(self.load_avg_start), "end": list(os.getloadavg())},
            "command": self.command,
            "env": {k: os.environ[k] for k in ENV_KEYS if k in os.environ},
            "commit": _git("rev-parse", "HEAD"),
            "tree_dirty": None if status is None else bool(status),
            "result": result,
        }

    def finish(self, result: dict, args: argparse.Namespace) -> Path | None:
        """Write the record where `--out` / `--save` asked; returns that path (None: nowhere)."""
        path = args.out
        if path is None and args.save:
            path = RESULTS_DIR / f"{self.benchmark}.json"
        if path is None:
            return None
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.document(result), indent=2) + "\n")
        return path
