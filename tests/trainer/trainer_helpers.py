"""Helpers shared by the trainer tests: HF reference log-probs, torchrun launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent

FAMILIES = ("qwen2", "qwen3", "llama")


def hf_response_logprobs(hf_model, tokens, prompt_lens, temperature: float = 1.0):
    """HF transformers' log-probs (and entropy) of each response token, one sequence at a time."""
    lps, ents = [], []
    with torch.no_grad():
        for seq, p in zip(tokens, prompt_lens):
            logits = hf_model(torch.tensor([seq])).logits[0].float() / temperature
            logp = torch.log_softmax(logits, dim=-1)
            rows = torch.arange(p - 1, len(seq) - 1)
            lps.append(logp[rows, torch.tensor(seq[p:])])
            ents.append(-(logp[rows].exp() * logp[rows]).sum(-1))
    return lps, ents


def max_abs_diff(xs, ys) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(xs, ys) if x.numel())


# torchrun's own rendezvous on ports the OS picks as they are bound (the launcher's store and
# the workers' world store): a port probed free and passed as --master_port can be taken by
# another process before rank 0 binds it
TORCHRUN_RENDEZVOUS = ("--standalone", "--local-addr=127.0.0.1")


def torchrun(script: Path, args: list[str], nproc: int = 2, timeout: int = 300) -> None:
    """Run `script` under torchrun with `nproc` CPU processes; fail the test on error."""
    repo = HERE.parent.parent
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(repo), str(repo / "tests"), str(HERE)]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        *TORCHRUN_RENDEZVOUS,
        str(script),
        *args,
    ]
    proc = subprocess.run(
        cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(repo)
    )
    if proc.returncode != 0:
        raise AssertionError(f"torchrun {script.name} {args} failed:\n{proc.stderr[-6000:]}")
