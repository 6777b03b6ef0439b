"""The suite's driver: plan, preflight, one subprocess per section, one JSON line per section.

Standard library only, and it never imports torch: the driver must not hold a CUDA context (the
colocation section measures the device's free memory from its own processes) and must keep
going when a section's process crashes, hangs or leaves children behind.

Every line it writes goes to the stream (stdout) and, with `out_dir`, to `gpu_suite.jsonl`
there, flushed at once, so a run cut short keeps every line it printed. The sections' own
stdout and stderr go to `gpu_suite.log` in `out_dir` (the last lines also into the JSON line
of a section that crashed, timed out or raised). Lines, in order:

    {"plan": {...}}                    the sections with their budgets, before anything runs
    {"section": "preflight", ...}      wheels installed, versions, device, imports per module
    {"section": NAME, "status": ...}   one per section, as each finishes
    {"summary": {"ok": ..., ...}}

A section's status is `ok`, `failed` (an exactness check failed), `error` (it raised: the
traceback is in the line), `crashed` (its process died without a result: exit code, log tail),
`timeout` (killed at its budget, with every thread's stack from faulthandler in the log tail and
the checks it had recorded) or `skipped` (with the reason). `ok` is true when no section failed,
errored, crashed or timed out and none was skipped for a reason other than what the machine
cannot do by design (the dry run's CUDA sections).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
JSONL_NAME = "gpu_suite.jsonl"
LOG_NAME = "gpu_suite.log"
LOG_TAIL_CHARS = 6000  # of a failing section's output, into its JSON line
LOG_KEEP_CHARS = 400_000  # of each section's output, into gpu_suite.log
KILL_GRACE_S = 5.0


@dataclass(frozen=True)
class Section:
    """One section: `target` ("module:function") runs in its own process and gets a
    `benchmarks.gpu_suite.context.Context`."""

    name: str
    target: str
    what: str  # one line for the plan
    budget_s: float  # its process's timeout on a GPU
    requires: tuple[str, ...] = ()  # modules the preflight imports; one missing skips it
    cpu: bool = False  # the dry run runs it on CPU at tiny sizes; else skipped: needs CUDA
    dry_run_budget_s: float = 180.0
    min_gpus: int = 1


@dataclass(frozen=True)
class SuiteOptions:
    dry_run: bool = False
    cap_s: float = 290.0  # the whole run, wheels and preflight included
    preflight_budget_s: float = 30.0
    out_dir: Path | None = None  # $OUT: gpu_suite.jsonl + gpu_suite.log
    wheel_dir: Path | None = None  # carried wheels, installed with --target before the preflight
    python: str = sys.executable
    extra_env: Mapping[str, str] = field(default_factory=dict)
    not_covered: tuple[str, ...] = ()


class SectionRun(NamedTuple):
    """How one section process ended."""

    returncode: int | None  # None: killed at its timeout
    timed_out: bool
    seconds: float
    log: str  # its stdout and stderr
    result: dict | None  # its result file, if it wrote one


class Emitter:
    """One JSON object per line, to the stream and to out_dir/gpu_suite.jsonl, flushed."""

    def __init__(self, stream: IO[str], out_dir: Path | None):
        self.stream = stream
        self.jsonl = self.log = None
        if out_dir is not None:
            out_dir.mkdir(parents=True, exist_ok=True)
            self.jsonl = (out_dir / JSONL_NAME).open("w")
            self.log = (out_dir / LOG_NAME).open("w")

    def line(self, obj: dict) -> None:
        text = json.dumps(obj, default=str)
        for f in (self.stream, self.jsonl):
            if f is not None:
                f.write(text + "\n")
                f.flush()

    def section_log(self, name: str, text: str) -> None:
        if self.log is not None:
            if len(text) > LOG_KEEP_CHARS:
                cut = len(text) - LOG_KEEP_CHARS
                text = f"[... {cut} chars cut ...]\n" + text[-LOG_KEEP_CHARS:]
            self.log.write(f"===== {name} =====\n{text}\n")
            self.log.flush()

    def close(self) -> None:
        for f in (self.jsonl, self.log):
            if f is not None:
                f.close()


def run_process(
    argv: list[str], env: dict[str, str], timeout_s: float, result_path: Path | None
) -> SectionRun:
    """Run argv in its own session (process group) with stdout + stderr to a temporary file.
    At the timeout, or when it exits, the whole group is killed: whatever it spawned (engine
    or trainer processes) goes with it, and nothing it left behind holds a pipe open."""
    start = time.monotonic()
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        timed_out = False
        try:
            proc.wait(timeout=max(timeout_s, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=KILL_GRACE_S)
            except subprocess.TimeoutExpired:
                pass
        _kill_group(proc.pid, signal.SIGKILL)
        proc.wait()
        seconds = time.monotonic() - start
        log.seek(0)
        text = log.read()
    result = None
    if result_path is not None and result_path.exists():
        try:
            result = json.loads(result_path.read_text())
        except ValueError:
            result = None
    return SectionRun(None if timed_out else proc.returncode, timed_out, seconds, text, result)


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def child_env(options: SuiteOptions, site_dir: Path | None, workdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(options.extra_env)
    paths = [str(site_dir)] if site_dir is not None else []
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    env["GPU_SUITE_WORKDIR"] = str(workdir)
    env["GPU_SUITE_DRY_RUN"] = "1" if options.dry_run else "0"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONFAULTHANDLER"] = "1"  # a segfault prints every thread's stack to the log
    # nothing is fetched at run time (the device machine reaches no network)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    if options.dry_run:
        env["TRITON_INTERPRET"] = "1"  # read when triton decorates the kernels: before import
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def tail(text: str, chars: int = LOG_TAIL_CHARS) -> str:
    return text if len(text) <= chars else "[...]\n" + text[-chars:]


def plan_line(sections: list[Section], options: SuiteOptions) -> dict:
    budgets = [
        {
            "name": s.name,
            "budget_s": budget_of(s, options),
            "runs": runs_where(s, options),
            "what": s.what,
        }
        for s in sections
    ]
    planned = options.preflight_budget_s + sum(
        b["budget_s"] for b in budgets if b["runs"] == "here"
    )
    return {
        "plan": {
            "dry_run": options.dry_run,
            "cap_s": options.cap_s,
            "planned_s": round(planned, 1),
            "preflight_budget_s": options.preflight_budget_s,
            "sections": budgets,
            "not_covered": list(options.not_covered),
        }
    }


def budget_of(section: Section, options: SuiteOptions) -> float:
    return section.dry_run_budget_s if options.dry_run else section.budget_s


def runs_where(section: Section, options: SuiteOptions) -> str:
    if options.dry_run and not section.cpu:
        return "skipped: needs CUDA"
    return "here"


def skip_reason(
    section: Section, options: SuiteOptions, preflight: dict
) -> tuple[str, bool] | None:
    """(reason, expected) when the section cannot run; expected: by design on this machine."""
    if options.dry_run and not section.cpu:
        return "needs CUDA", True
    if preflight.get("status") != "ok":
        return f"preflight {preflight.get('status')}: {preflight.get('error', '')}".strip(), False
    env = preflight.get("env", {})
    if not options.dry_run:
        if not env.get("cuda"):
            return "needs CUDA: torch.cuda.is_available() is False", False
        if env.get("device_count", 0) < section.min_gpus:
            return f"needs {section.min_gpus} GPUs; {env.get('device_count', 0)} here", True
    imports = preflight.get("imports", {})
    for module in section.requires:
        error = imports.get(module, "not checked")
        if error is not None:
            return f"missing {module}: {error}", False
    return None


def section_line(section: Section, run: SectionRun, budget: float) -> dict:
    result = run.result or {}
    checks = result.get("checks", [])
    line: dict[str, Any] = {
        "section": section.name,
        "seconds": round(run.seconds, 1),
        "budget_s": budget,
        "checks": checks,
        "result": result.get("result", result.get("partial", {})),
    }
    failed_checks = [c["name"] for c in checks if not c.get("ok")]
    if run.timed_out:
        line.update(status="timeout", error=f"killed after its budget of {budget:.0f} s")
    elif result.get("traceback"):
        line.update(status="error", error=result.get("error"), traceback=result["traceback"])
    elif run.returncode != 0 or "result" not in result:
        line.update(
            status="crashed",
            error=f"section process exited with code {run.returncode} and no result",
        )
    elif failed_checks:
        line.update(status="failed", error=f"checks failed: {', '.join(failed_checks)}")
    else:
        line.update(status="ok")
    if line["status"] != "ok":
        line["log_tail"] = tail(run.log)
    line["ok"] = line["status"] == "ok"
    return line


def run_suite(sections: list[Section], options: SuiteOptions, stream: IO[str] = sys.stdout) -> int:
    """Run the plan; returns the exit code (0: ok, 1: not ok)."""
    started = time.monotonic()
    deadline = started + options.cap_s
    emit = Emitter(stream, options.out_dir)
    emit.line(plan_line(sections, options))
    lines: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as tmp:
        workdir = Path(tmp)
        preflight = run_preflight(sections, options, workdir, emit, deadline)
        site = preflight.get("wheels", {}).get("site")
        env = child_env(options, Path(site) if site else None, workdir)
        for section in sections:
            budget = budget_of(section, options)
            skip = skip_reason(section, options, preflight)
            remaining = deadline - time.monotonic()
            if skip is None and remaining < min(budget, 10.0):
                skip = (f"the suite's cap of {options.cap_s:.0f} s is spent", False)
            if skip is not None:
                line = {
                    "section": section.name,
                    "status": "skipped",
                    "ok": None,
                    "skipped": skip[0],
                    "expected": skip[1],
                }
            else:
                timeout = min(budget, remaining)
                result_path = workdir / f"{section.name}.result.json"
                run = run_process(
                    [options.python, "-m", "benchmarks.gpu_suite.child", section.target],
                    {
                        **env,
                        "GPU_SUITE_RESULT": str(result_path),
                        "GPU_SUITE_TIMEOUT_S": str(timeout),
                    },
                    timeout,
                    result_path,
                )
                emit.section_log(section.name, run.log)
                line = section_line(section, run, round(timeout, 1))
            lines.append(line)
            emit.line(line)
    summary = summarize(preflight, lines, time.monotonic() - started)
    emit.line({"summary": summary})
    emit.close()
    return 0 if summary["ok"] else 1


def summarize(preflight: dict, lines: list[dict], seconds: float) -> dict:
    unexpected_skips = {
        ln["section"]: ln["skipped"]
        for ln in lines
        if ln["status"] == "skipped" and not ln.get("expected")
    }
    bad = [ln for ln in lines if ln["status"] not in ("ok", "skipped")]
    return {
        "ok": preflight.get("status") == "ok" and not bad and not unexpected_skips,
        "statuses": {ln["section"]: ln["status"] for ln in lines},
        "failed_checks": [
            f"{ln['section']}.{c['name']}"
            for ln in lines
            for c in ln.get("checks", [])
            if not c.get("ok")
        ],
        "not_ok": {ln["section"]: ln.get("error") for ln in bad},
        "skipped": {ln["section"]: ln["skipped"] for ln in lines if ln["status"] == "skipped"},
        "seconds": round(seconds, 1),
        "device": preflight.get("env", {}).get("device"),
    }


def run_preflight(
    sections: list[Section], options: SuiteOptions, workdir: Path, emit: Emitter, deadline: float
) -> dict:
    """Install the carried wheels, then import every module a section requires (each on its
    own, in one process) and read the versions and the device."""
    from benchmarks.gpu_suite import wheels

    started = time.monotonic()
    line: dict[str, Any] = {"section": "preflight"}
    try:
        line["wheels"] = wheels.install(options.wheel_dir, workdir / "site", options.python)
    except wheels.WheelInstallError as e:
        line["wheels"] = {"error": str(e)}
    site = line["wheels"].get("site")
    env = child_env(options, Path(site) if site else None, workdir)
    modules = sorted({m for s in sections for m in s.requires})
    result_path = workdir / "preflight.result.json"
    timeout = min(options.preflight_budget_s, max(deadline - time.monotonic(), 1.0))
    run = run_process(
        [options.python, "-m", "benchmarks.gpu_suite.preflight", *modules],
        {**env, "GPU_SUITE_RESULT": str(result_path)},
        timeout,
        result_path,
    )
    emit.section_log("preflight", run.log)
    if run.timed_out:
        line.update(status="timeout", error=f"killed after {timeout:.0f} s")
    elif run.result is None:
        line.update(status="crashed", error=f"exit code {run.returncode}")
    else:
        line.update(status="ok", **run.result)
    if line["status"] != "ok":
        line["log_tail"] = tail(run.log)
    line["seconds"] = round(time.monotonic() - started, 1)
    emit.line(line)
    return line
