"""The GPU suite's harness (benchmarks/gpu_suite/harness.py) on CPU, with sections that break
the ways GPU sections do (tests/gpu_suite/suite_sections.py): a missing import is skipped with
its reason by the preflight, a failed check / exception / crash / hang is reported with its
checks, traceback or stacks and the next section still runs, every line is streamed to the
stream and to the output folder, `ok` and the exit status follow the rules, the time cap holds,
and carried wheels are installed and importable. The real sections' dry run is
test_gpu_suite_dry_run.py."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import psutil

from benchmarks.gpu_suite.harness import JSONL_NAME, LOG_NAME, Section, SuiteOptions, run_suite

HERE = Path(__file__).resolve().parent
MISSING = "gpu_suite_no_such_module"


def section(name: str, function: str, **kw) -> Section:
    kw.setdefault("cpu", True)
    kw.setdefault("dry_run_budget_s", 60)
    return Section(name, f"suite_sections:{function}", f"the {function} section", 60, **kw)


def run(sections: list[Section], tmp_path: Path, **options) -> tuple[int, list[dict]]:
    stream = io.StringIO()
    options.setdefault("out_dir", tmp_path / "out")
    code = run_suite(
        sections,
        SuiteOptions(dry_run=True, extra_env={"PYTHONPATH": str(HERE)}, **options),
        stream,
    )
    return code, [json.loads(line) for line in stream.getvalue().splitlines()]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_every_failure_is_reported_and_the_next_section_still_runs(tmp_path):
    sections = [
        section("passes", "passes"),
        section("missing_import", "passes", requires=(MISSING,)),
        section("fails_check", "fails_check"),
        section("raises", "raises"),
        section("crashes", "crashes"),
        section("hangs", "hangs", dry_run_budget_s=6),
        section("gpu_only", "passes", cpu=False),
        section("after_all_that", "passes"),
    ]
    code, lines = run(sections, tmp_path)
    plan, preflight, *per_section, summary = lines

    # the plan first, with each section's budget and where it runs
    budgets = {s["name"]: (s["budget_s"], s["runs"]) for s in plan["plan"]["sections"]}
    assert budgets["hangs"] == (6, "here") and budgets["gpu_only"][1] == "skipped: needs CUDA"
    assert plan["plan"]["planned_s"] == plan["plan"]["preflight_budget_s"] + 6 * 60 + 6

    # the preflight imported each module on its own and recorded the failure
    assert preflight["section"] == "preflight" and preflight["status"] == "ok"
    assert preflight["env"]["python"] and preflight["env"]["cuda"] is False
    assert MISSING in preflight["imports"][MISSING]

    by_name = {line["section"]: line for line in per_section}
    assert [line["section"] for line in per_section] == [s.name for s in sections]
    statuses = {name: line["status"] for name, line in by_name.items()}
    assert statuses == {
        "passes": "ok",
        "missing_import": "skipped",
        "fails_check": "failed",
        "raises": "error",
        "crashes": "crashed",
        "hangs": "timeout",
        "gpu_only": "skipped",
        "after_all_that": "ok",
    }
    assert by_name["passes"]["result"] == {"figure": 42, "dry_run": True, "device": "cpu"}
    assert by_name["passes"]["checks"] == [{"name": "agrees", "ok": True, "max_err": 0.0}]
    missing = by_name["missing_import"]
    assert missing["skipped"].startswith(f"missing {MISSING}: ModuleNotFoundError")
    assert missing["expected"] is False
    assert by_name["gpu_only"]["skipped"] == "needs CUDA" and by_name["gpu_only"]["expected"]

    failed = by_name["fails_check"]
    assert [c["ok"] for c in failed["checks"]] == [True, False] and failed["ok"] is False
    assert failed["checks"][1] == {"name": "exact", "ok": False, "max_err": 0.5, "bound": 1e-4}

    raised = by_name["raises"]
    assert raised["error"] == "ValueError: boom in a section"
    assert "Traceback (most recent call last)" in raised["traceback"]
    assert 'raise ValueError("boom in a section")' in raised["traceback"]
    assert raised["checks"] == [{"name": "before", "ok": True}]

    crashed = by_name["crashes"]
    assert "exited with code -6" in crashed["error"]
    assert "Fatal Python error: Aborted" in crashed["log_tail"]
    assert "in crashes" in crashed["log_tail"]  # faulthandler's stack of the dying thread
    assert crashed["checks"] == [{"name": "before_crash", "ok": True}]

    hung = by_name["hangs"]
    assert hung["error"] == "killed after its budget of 6 s" and 6 <= hung["seconds"] < 15
    assert "in hangs" in hung["log_tail"]  # every thread's stack, dumped before the kill
    assert hung["checks"] == [{"name": "before_hang", "ok": True}]
    assert not alive(hung["result"]["grandchild_pid"])  # its process group went with it

    assert code == 1
    assert summary["summary"]["ok"] is False
    assert summary["summary"]["failed_checks"] == ["fails_check.exact"]
    assert set(summary["summary"]["not_ok"]) == {"fails_check", "raises", "crashes", "hangs"}
    assert summary["summary"]["skipped"] == {
        "missing_import": missing["skipped"],
        "gpu_only": "needs CUDA",
    }

    # $OUT: the same lines, and every section's output under its name
    out = tmp_path / "out"
    assert [json.loads(x) for x in (out / JSONL_NAME).read_text().splitlines()] == lines
    log = (out / LOG_NAME).read_text()
    assert "===== crashes =====" in log and "Fatal Python error: Aborted" in log


def test_ok_when_every_section_that_can_run_passes(tmp_path):
    code, lines = run(
        [section("passes", "passes"), section("gpu_only", "passes", cpu=False)],
        tmp_path,
        out_dir=None,
    )
    assert code == 0 and lines[-1]["summary"]["ok"] is True
    assert lines[-1]["summary"]["statuses"] == {"passes": "ok", "gpu_only": "skipped"}


def test_the_time_cap_holds(tmp_path):
    """A section that hangs gets at most what is left of the cap, and the next one is skipped
    (not ok: it did not run)."""
    code, lines = run([section("hangs", "hangs"), section("passes", "passes")], tmp_path, cap_s=16)
    hung, skipped, summary = lines[2], lines[3], lines[4]["summary"]
    assert hung["status"] == "timeout" and hung["seconds"] < 16
    assert skipped["status"] == "skipped" and "cap of 16 s is spent" in skipped["skipped"]
    assert code == 1 and summary["ok"] is False and summary["seconds"] < 16 + 6


def make_wheel(directory: Path, name: str, version: str, tag: str, value: int) -> Path:
    """A minimal wheel with one module `name` holding VALUE."""
    dist = f"{name}-{version}.dist-info"
    path = directory / f"{name}-{version}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as whl:
        whl.writestr(f"{name}/__init__.py", f"VALUE = {value}\n")
        whl.writestr(
            f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        whl.writestr(
            f"{dist}/WHEEL",
            f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: {tag}\n",
        )
        whl.writestr(f"{dist}/RECORD", "")
    return path


def test_carried_wheels_are_installed_and_importable(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels, "gpu_suite_probe", "1.0", "py3-none-any", 7)
    make_wheel(wheels, "gpu_suite_other", "1.0", "cp27-cp27-manylinux1_x86_64", 0)
    make_wheel(wheels, "PyYAML", "0.1", "py3-none-any", 0)  # older than the one installed
    code, lines = run(
        [section("probe", "imports_probe", requires=("gpu_suite_probe",))],
        tmp_path,
        wheel_dir=wheels,
    )
    installed = lines[1]["wheels"]
    assert installed["installed"] == ["gpu-suite-probe==1.0"]
    assert installed["unfit"] == ["gpu_suite_other-1.0-cp27-cp27-manylinux1_x86_64.whl"]
    assert list(installed["present"]) == ["pyyaml"]
    assert lines[1]["imports"] == {"gpu_suite_probe": None}
    assert lines[2]["status"] == "ok" and lines[2]["result"] == {"probe": 7}
    assert code == 0


def test_the_gpu_plan_fits_in_five_minutes():
    """Budgets are timeouts: their sum with the preflight's stays under the harness's cap, and
    that under gpu_suite.sh's backstop of 300 s, so a rerun fits a 15-minute device budget."""
    from benchmarks.gpu_suite.__main__ import GPU_CAP_S, parse_args
    from benchmarks.gpu_suite.harness import REPO, plan_line
    from benchmarks.gpu_suite.sections import SECTIONS

    args = parse_args([])
    options = SuiteOptions(cap_s=GPU_CAP_S)
    plan = plan_line([s for s in SECTIONS if s.name in args.sections], options)["plan"]
    assert plan["planned_s"] <= GPU_CAP_S <= 295
    assert all(s["runs"] == "here" for s in plan["sections"])
    script = (REPO / "benchmarks" / "gpu_suite.sh").read_text()
    assert "CAP=300\n" in script and 'timeout --kill-after=5 "$CAP"' in script
