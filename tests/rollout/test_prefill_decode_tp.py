"""Prefill-decode disaggregation between tensor-parallel engines against one such engine doing
both: a prefill replica of TP 2 and a decode replica of TP 2 (2 CPU processes, gloo), the
reference a third TP 2 replica with the same weights and seeds (`Engine.generate`'s path).

Each rank holds half the KV heads. The prefill replica's handoff carries every head (its ranks'
shares gathered on rank 0); the decode replica's rank 0 sends it to its follower with the next
step's pool operations, and each rank copies its own heads into its pages. Checked, for a dense
model and a mixture of experts (its routes from the prefill side) in float64: tokens, finish
reasons and routes equal, log-probs within 1e-12 of the reference, for n = 3 (forks copying a
partly filled page on every rank) cold, then with prefix hits on both sides, and for multi-turn
sessions (each turn prefilled again, decoded where the earlier turns are cached); the handoff's
K/V has the model's KV heads, twice a rank's.

One process per rank hosts all three replicas: the three replicas' groups span the same two
ranks, and rank 1 serves each as a follower on its own thread.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from two_ranks import join_world, run_two_ranks

from rollout import EngineConfig, SamplingParams

from tiny_hf import make_hf_model, save_hf_model

FAMILIES = ("qwen2", "qwen3_moe")
ATOL = 1e-12
PREFIX = [3, 17, 5, 29, 11, 7, 23]  # 7 tokens: with page_size 4 a partly filled last page
PROMPTS = [PREFIX + [2, 41], PREFIX + [13], [43, 8, 61, 4, 9], PREFIX + [31, 19, 37]]
SAMPLED = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=9, seed=11)
DEADLINE_S = 600


def _config(directory: str) -> EngineConfig:
    return EngineConfig(
        model_path=directory, dtype="float64", kv_cache_tokens=512, page_size=4, seed=0, tp=2
    )


def _plain(out) -> tuple:
    """A RequestOutput as plain values to compare."""
    routes = None if out.routed_experts is None else [r.tolist() for r in out.routed_experts]
    samples = [(s.token_ids, s.logprobs, s.finish_reason) for s in out.samples]
    return out.prompt_token_ids, samples, routes


def _run(engine, prompts, params, handoffs=None) -> list:
    """Every prompt's output, in order: generated, or decoded from `handoffs`."""
    if handoffs is None:
        ids = [engine.add_request(p, params) for p in prompts]
    else:
        ids = [engine.admit_prefilled(h, params) for h in handoffs]
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step())
    engine.check_integrity()
    return [done[i] for i in ids]


def scenarios(prefiller, decoder, single) -> dict:
    """Cold, prefix hits, then multi-turn sessions; for each, the PD outputs, the reference's,
    and the cached tokens each side reported."""
    from rollout.prefill_decode import prefill

    result: dict = {"kv_heads": [], "pool_heads": decoder.pool.num_kv_heads}

    def both(name, prompts, params) -> list:
        handoffs = prefill(prefiller, prompts, params)
        prefiller.check_integrity()
        result["kv_heads"] += [h.k.shape[1] for h in handoffs]
        got, want = _run(decoder, prompts, params, handoffs), _run(single, prompts, params)
        result[name] = (
            [_plain(o) for o in got],
            [_plain(o) for o in want],
            [h.cached_tokens for h in handoffs],
            [w.cached_tokens for w in want],
        )
        return want

    both("cold", PROMPTS, SAMPLED)
    result["decode_cached_after_cold"] = decoder.stats()["prefix_cache_tokens"]
    both("hits", PROMPTS, SAMPLED)
    sessions = [[3, 17, 5], [43, 8, 61, 4, 9, 2]]
    for turn in range(3):
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=turn, ignore_eos=True)
        want = both(f"turn{turn}", sessions, params)
        sessions = [s + out.samples[0].token_ids + [11 + turn] for s, out in zip(sessions, want)]
    return result


def _rank(rank: int, rendezvous: str, dirs: dict, out_dir: str) -> None:
    import torch.distributed as dist

    from rollout.tp_follower import run_rank

    torch.set_num_threads(1)
    join_world(rank, rendezvous)
    for family, directory in dirs.items():
        config = _config(directory)
        groups = [dist.new_group([0, 1]) for _ in range(3)]  # prefill, decode, reference
        if rank == 0:
            engines = [run_rank(config, g) for g in groups]
            result = scenarios(*engines)
            for engine in engines:
                engine.close()
            torch.save(result, Path(out_dir) / f"{family}.pt")
        else:
            threads = [threading.Thread(target=run_rank, args=(config, g)) for g in groups]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    dirs = {
        f: str(save_hf_model(make_hf_model(f, seed=0), tmp_path_factory.mktemp(f)))
        for f in FAMILIES
    }
    out_dir = tmp_path_factory.mktemp("pd_tp2_results")
    run_two_ranks(_rank, (dirs, str(out_dir)), out_dir, DEADLINE_S)
    return {f: torch.load(out_dir / f"{f}.pt") for f in FAMILIES}


def assert_same(got: list, want: list) -> None:
    for (g_prompt, g_samples, g_routes), (w_prompt, w_samples, w_routes) in zip(
        got, want, strict=True
    ):
        assert g_prompt == w_prompt
        for (g_tokens, g_logprobs, g_reason), (w_tokens, w_logprobs, w_reason) in zip(
            g_samples, w_samples, strict=True
        ):
            assert g_tokens == w_tokens and g_reason == w_reason
            assert len(g_logprobs) == len(w_logprobs)
            diff = max((abs(a - b) for a, b in zip(g_logprobs, w_logprobs)), default=0.0)
            assert diff <= ATOL, diff
        assert g_routes == w_routes


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_prefill_and_decode_replicas_equal_one_tp2_replica(family, results):
    result = results[family]
    # the handoff carries every KV head; each decode rank kept its half
    assert set(result["kv_heads"]) == {2 * result["pool_heads"]}
    for name in ("cold", "hits", "turn0", "turn1", "turn2"):
        assert_same(*result[name][:2])
    for name in ("cold", "hits"):  # the prefill replica's cache hits are the reference's
        cached, want_cached = result[name][2:]
        assert cached == want_cached, name
    assert any(result["hits"][2]) and not any(result["cold"][2])
    assert result["decode_cached_after_cold"] > 0  # the decode side inserted the prompts
    # The prefill replica never saw the completions: a later turn finds the earlier prompts'
    # whole pages in its cache (the reference holds whole turns).
    previous = [[3, 17, 5], [43, 8, 61, 4, 9, 2]]
    for turn in (1, 2):
        got = result[f"turn{turn}"][0]
        assert result[f"turn{turn}"][2] == [len(p) // 4 * 4 for p in previous]
        previous = [prompt for prompt, _, _ in got]
    if family == "qwen3_moe":
        assert all(o[2] is not None for o in result["cold"][0])
