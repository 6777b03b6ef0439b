"""Start-up failures a new user meets, each through the real command line (a subprocess): exit
code 2, one line on stderr naming the field or file and the fix, found before Ray starts.
And overrides are accepted before and after flags."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_arith_grpo.yaml"


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    # RAY_ADDRESS points nowhere: a check that let the run reach Ray would fail differently
    return subprocess.run(
        [sys.executable, "-m", "miles_like.train", str(RECIPE), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(ROOT),
            "HOME": str(cwd),
            "MILES_LIKE_CACHE": str(cwd / "cache"),
        },
    )


@pytest.fixture(scope="module")
def files(tiny_hf_checkpoints, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("startup")
    _, model_dir = tiny_hf_checkpoints("qwen3")  # vocab_size 101: not the character tokenizer's
    no_weights = root / "no_weights"
    no_weights.mkdir()
    shutil.copy(Path(model_dir) / "config.json", no_weights / "config.json")
    (root / "a_file").write_text("not a directory")
    damaged = root / "damaged_run"
    step = damaged / "checkpoints" / "step_000002"
    step.mkdir(parents=True)
    (step / "state.json").write_text('{"next_step": 3, "format"')  # cut short
    data = root / "questions.jsonl"
    data.write_text(
        "\n".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) for i in range(4))
        + "\n"
    )
    return {
        "model": Path(model_dir),
        "no_weights": no_weights,
        "file": root / "a_file",
        "damaged": damaged,
        "data": data,
        "root": root,
    }


def _cases(f: dict[str, Path]) -> dict[str, tuple[list[str], list[str]]]:
    """case -> (arguments, what the one line must name)."""
    return {
        "model without weights": (
            ["model.builtin=null", f"model.path={f['no_weights']}"],
            ["model.path=", str(f["no_weights"]), "no weights", "model.safetensors"],
        ),
        "output_dir is a file": (
            [f"tracking.output_dir={f['file']}"],
            ["tracking.output_dir=", str(f["file"]), "is a file"],
        ),
        "draft with another vocabulary": (
            [
                "rollout.speculative_method=draft",
                f"rollout.speculative_draft_model_path={f['model']}",
            ],
            ["rollout.speculative_draft_model_path=", "vocab_size 101", "tokenizer"],
        ),
        "cuda without CUDA": (
            ["cluster.accelerator=cuda"],
            ["cluster.accelerator=cuda", "no usable CUDA device", "auto or cpu"],
        ),
        "damaged state.json on resume": (
            [f"tracking.output_dir={f['damaged']}", "checkpoint.resume=auto"],
            [
                "checkpoint.resume",
                str(f["damaged"] / "checkpoints" / "step_000002" / "state.json"),
                "damaged",
            ],
        ),
        "dry run, data without the prompt column": (
            ["--dry-run", "data.synthetic=null", f"data.path={f['data']}"],
            ["data.prompt_key='prompt'", "questions.jsonl", "no such column", "question"],
        ),
        "real run, data without the prompt column": (
            ["data.synthetic=null", f"data.path={f['data']}"],
            ["data.prompt_key='prompt'", "questions.jsonl", "no such column", "question"],
        ),
        "routing replay on a dense model": (
            ["algorithm.routing_replay=rollout"],
            ["algorithm.routing_replay=rollout", "not a mixture of experts", "routing_replay: off"],
        ),
        "load-balancing loss on the deepspeed backend": (
            [
                "model.builtin=tiny-qwen3-moe",
                "model.dtype=float32",
                "trainer.backend=deepspeed",
                "trainer.moe_aux_loss_coeff=0.01",
            ],
            ["trainer.moe_aux_loss_coeff > 0", "megatron", "set it to 0"],
        ),
    }


CASES = list(_cases({k: Path(k) for k in ("model", "no_weights", "file", "damaged", "data")}))


@pytest.mark.parametrize("case", CASES)
def test_startup_error_is_one_line_exit_2(files, case):
    if case == "cuda without CUDA":
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has CUDA")
    args, needles = _cases(files)[case]
    out = files["root"] / case.replace(" ", "_")  # this case's own, so the check below is its
    if not any(a.startswith("tracking.output_dir=") for a in args):
        args = [*args, f"tracking.output_dir={out}"]
    result = cli(*args, cwd=files["root"])
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    assert not (out / "recipe.yaml").exists()  # stopped before the run began


@pytest.mark.parametrize(
    "order",
    [
        ["--dry-run", "rollout.n=4", "trainer.lr=1e-5"],
        ["rollout.n=4", "--dry-run", "trainer.lr=1e-5"],
        ["rollout.n=4", "trainer.lr=1e-5", "--dry-run"],
    ],
)
def test_overrides_before_and_after_flags(tmp_path, order):
    result = cli(*order, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)
    assert resolved["rollout"]["n"] == 4 and resolved["trainer"]["lr"] == 1e-5
