"""One engine-TP run of the default recipe for the end-to-end tests, and what they check after
it: the state of the last engine replica read from the live actors before shutdown, compared
with slices of the trainer's export (`tp_slices.py`, the layout rules written out)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import ray
from safetensors.torch import load_file
from tp_slices import digest, expected_slice

from miles_like.recipe.cli import main
from miles_like.run.actors import RunActors
from miles_like.run.loop import run

ROOT = Path(__file__).resolve().parents[2]

# the default recipe's first steps, small, with a TP=2 engine
TP2_RUN = (
    "steps=2",
    "sft.steps=0",
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "rollout.kv_cache_tokens=1024",
    "rollout.tp=2",
    "tracking.wandb_mode=disabled",
)


class TPRun(NamedTuple):
    rows: list[dict]
    trainer_hf: dict  # the trainer's full weights after the run (its Hugging Face export)
    replica: list  # the engine replica alive at the end, one actor per rank
    digests: list[dict[str, str]]  # per engine rank: parameter name -> sha256 of its bytes


def run_tp_recipe(tmp_path: Path, monkeypatch, *overrides: str) -> TPRun:
    """Trains `TP2_RUN` + `overrides`; just before shutdown, saves the trainer's export and reads
    every engine rank's parameter digests."""
    seen: dict = {}
    shutdown = RunActors.shutdown

    def observe_then_shutdown(self, graceful=True):
        if graceful and self.replicas:
            self.save_hf(tmp_path / "trainer_hf")
            seen["replica"] = self.replicas[0]
            seen["digests"] = ray.get([r.weight_digests.remote() for r in self.replicas[0]])
        shutdown(self, graceful)

    monkeypatch.setattr(RunActors, "shutdown", observe_then_shutdown)
    out = tmp_path / "run"
    recipe = str(ROOT / "recipes" / "tiny_arith_grpo.yaml")
    code = main([recipe, f"tracking.output_dir={out}", *TP2_RUN, *overrides], run=run)
    assert code == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    full = load_file(tmp_path / "trainer_hf" / "model.safetensors")
    return TPRun(rows, full, seen["replica"], seen["digests"])


def assert_ranks_hold_slices(result: TPRun, k: int = 2) -> list[int]:
    """Every engine rank's parameters are bitwise the layout rules' slices of the trainer's
    weights; returns the bytes of each rank's slices."""
    assert len(result.digests) == k
    nbytes = []
    for rank, digests in enumerate(result.digests):
        assert set(digests) == set(result.trainer_hf)
        pieces = {name: expected_slice(name, t, k, rank) for name, t in result.trainer_hf.items()}
        for name, piece in pieces.items():
            assert digests[name] == digest(piece), f"rank {rank}: {name}"
        nbytes.append(sum(p.numel() * p.element_size() for p in pieces.values()))
    return nbytes
