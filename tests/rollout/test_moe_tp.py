"""Engine tensor parallelism on mixtures of experts: one replica over 2 CPU processes (gloo)
against TP=1 and HF transformers on the same weights.

Each expert's intermediate dimension is split over the ranks like the dense MLP (gate/up by
rows, down_proj by columns; the experts' partial outputs summed by one all-reduce per layer),
Qwen2-MoE's shared expert too; the router is replicated. One spawn of 2 ranks runs the same
scenario for Qwen3-MoE and Qwen2-MoE in float32 and float64; the parent runs it on a TP=1
engine and checks:

* greedy tokens equal TP=1's token for token, log-probs within 1e-5 (float32) / 1e-10
  (float64), `routed_experts` bitwise equal; and TP=2's outputs pass the HF checks of
  `moe_reference.check_against_hf` (tokens, log-probs, every token's routes);
* the second, prefix-cache-hit call (rank 0 reads the routes kept beside the reused pages)
  returns the cold call's routes;
* update_weights with every HF tensor of another model (router and per-expert weights, full
  tensors each rank narrows to its share): outputs equal TP=1's after the same update.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from moe_reference import (
    CASES,
    DTYPES,
    GREEDY,
    PROMPTS,
    assert_same,
    check_against_hf,
    make_checkpoints,
    run,
)
from safetensors.torch import load_file
from two_ranks import join_world, run_two_ranks

from rollout import Engine, EngineConfig

DEADLINE_S = 600


def _config(directory: str, dtype: str, tp: int) -> EngineConfig:
    return EngineConfig(model_path=directory, dtype=dtype, kv_cache_tokens=512, page_size=4, tp=tp)


def scenarios(engine: Engine, other_directory: str) -> dict:
    """The same calls on any engine; returns the outputs to compare."""
    result = {"cold": run(engine, PROMPTS, GREEDY)}
    result["warm"] = run(engine, PROMPTS, GREEDY)
    result["hits"] = engine.stats()["prefix_cache_hit_tokens"]
    engine.update_weights(load_file(str(Path(other_directory) / "model.safetensors")).items())
    result["updated"] = run(engine, PROMPTS, GREEDY)
    return result


def _rank(rank: int, rendezvous: str, dirs: dict, out_dir: str) -> None:
    import torch.distributed as dist

    from rollout.tp_follower import run_rank

    torch.set_num_threads(1)
    join_world(rank, rendezvous)
    for (family, dtype), (directory, other) in dirs.items():
        engine = run_rank(_config(directory, dtype, tp=2))
        if engine is not None:
            result = scenarios(engine, other)
            engine.close()
            torch.save(result, Path(out_dir) / f"{family}_{dtype}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return make_checkpoints(tmp_path_factory)


@pytest.fixture(scope="module")
def tp2_results(checkpoints, tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("moe_tp2_results")
    dirs = {case: (d, other) for case, (_, d, other) in checkpoints.items()}
    run_two_ranks(_rank, (dirs, str(out_dir)), out_dir, DEADLINE_S)
    return {
        case: torch.load(out_dir / f"{case[0]}_{case[1]}.pt", weights_only=False) for case in CASES
    }


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize("family,dtype", CASES)
def test_moe_tp2_equals_tp1_and_hf(family, dtype, checkpoints, tp2_results):
    hf_model, directory, other = checkpoints[family, dtype]
    atol = DTYPES[dtype][1]
    tp2 = tp2_results[family, dtype]
    tp1 = scenarios(Engine(_config(directory, dtype, tp=1)), other)
    for name in ("cold", "warm", "updated"):
        assert_same(tp2[name], tp1[name], atol)
    assert_same(tp2["warm"], tp2["cold"], atol)
    assert tp2["hits"] == tp1["hits"] > 0
    for name in ("cold", "warm"):
        for prompt, out in zip(PROMPTS, tp2[name]):
            check_against_hf(hf_model, prompt, out, dtype)
