"""Wheels carried in the working tree to a machine with no package registry.

`download_wheels.sh` fills the git-ignored `.gpu_wheels/` with the cp312 manylinux wheels listed
in `wheels.txt`; on the GPU machine the harness installs those it needs with `pip install
--no-index --no-deps --target <site>` and puts `<site>` first on the sections' PYTHONPATH. A
wheel is skipped when this interpreter already has that distribution at the same or a newer
version, or when its tags do not fit this interpreter (a cp312 wheel on a dev box's 3.11).
"""

from __future__ import annotations

import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import NamedTuple

PIP_TIMEOUT_S = 120


class WheelInstallError(RuntimeError):
    pass


class Wheel(NamedTuple):
    path: Path
    name: str  # normalized distribution name
    version: str
    python_tags: tuple[str, ...]
    platform_tags: tuple[str, ...]

    @classmethod
    def parse(cls, path: Path) -> Wheel:
        parts = path.name[: -len(".whl")].split("-")
        if len(parts) not in (5, 6):
            raise WheelInstallError(f"{path.name}: not a wheel file name")
        name, version, python, platform_ = parts[0], parts[1], parts[-3], parts[-1]
        return cls(
            path,
            normalize(name),
            version,
            tuple(python.split(".")),
            tuple(platform_.split(".")),
        )

    def fits_this_interpreter(self) -> bool:
        here = f"cp{sys.version_info.major}{sys.version_info.minor}"
        python_ok = any(t in (here, "py3", f"py{sys.version_info.major}") for t in self.python_tags)
        machine = platform.machine()
        platform_ok = any(
            t == "any" or (sys.platform.startswith("linux") and t.endswith(machine))
            for t in self.platform_tags
        )
        return python_ok and platform_ok


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def version_key(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:4])


def installed_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def install(wheel_dir: Path | None, site_dir: Path, python: str = sys.executable) -> dict:
    """Install what the carried wheels add to this interpreter; returns what was done. `site`
    is None when nothing was installed (nothing to put on PYTHONPATH)."""
    report: dict = {"dir": str(wheel_dir) if wheel_dir else None, "site": None}
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir and wheel_dir.is_dir() else []
    chosen, present, unfit = [], {}, []
    for path in wheels:
        wheel = Wheel.parse(path)
        have = installed_version(wheel.name)
        if have is not None and version_key(have) >= version_key(wheel.version):
            present[wheel.name] = have
        elif not wheel.fits_this_interpreter():
            unfit.append(path.name)
        else:
            chosen.append(wheel)
    report.update(
        installed=[f"{w.name}=={w.version}" for w in chosen], present=present, unfit=unfit
    )
    if not chosen:
        return report
    site_dir.mkdir(parents=True, exist_ok=True)
    argv = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
    argv += ["--no-cache-dir", "--target", str(site_dir), *(str(w.path) for w in chosen)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise WheelInstallError(f"pip install --target failed: {e}") from e
    if proc.returncode != 0:
        raise WheelInstallError(f"pip install --target exited {proc.returncode}: {proc.stderr}")
    report["site"] = str(site_dir)
    return report
