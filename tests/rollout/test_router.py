"""The router: cache-aware choice on hand-built prefixes, load balancing, session stickiness,
round-robin, the bounded prefix tree; and, through its HTTP front over 2 live in-process
replicas, multi-turn sessions: recorded turns equal what the replicas served, and the prefix
cache hit rate on turns >= 2 is higher cache-aware than round-robin (measured by the engines'
own per-request `cached_tokens`, not by the router)."""

from __future__ import annotations

import random

import httpx
import pytest

from rollout import Engine, EngineConfig
from rollout.async_engine import AsyncEngine
from rollout.serving.router import PrefixTree, Router, RouterConfig
from rollout.serving.router_app import build_router_app
from rollout.serving.server import build_app, start_server

from tiny_hf import make_hf_model, save_hf_model


def test_prefix_tree_match_insert_and_lru_eviction():
    tree = PrefixTree(max_tokens=8)
    tree.insert([1, 2, 3, 4])
    tree.insert([1, 2, 9])
    assert tree.match([1, 2, 3, 4, 5]) == 4 and tree.match([1, 2, 9, 9]) == 3
    assert tree.match([2]) == 0 and tree.num_tokens == 5
    tree.insert([7, 7, 7, 7])  # 9 tokens > 8: the least recently used leaf goes ([1,2,3,4]'s 4)
    assert tree.num_tokens == 8
    assert tree.match([1, 2, 3, 4]) == 3 and tree.match([1, 2, 9]) == 3
    assert tree.match([7, 7, 7, 7]) == 4


def test_cache_aware_picks_longest_prefix_then_balances_load():
    router = Router(3, RouterConfig(balance_threshold=2))
    system = list(range(100, 140))
    router.record(1, system + [1, 2, 3])
    router.record(2, system[:10])
    assert router.choose(system + [1, 2, 3, 4]) == 1  # longest match
    assert router.choose(system + [5]) == 1  # 40 tokens on 1 vs 10 on 2
    assert router.choose([9, 9, 9]) == 0  # no match: least loaded, then
    assert router.choose([8, 8]) == 0  # the smallest tree (0 < 10 < 43)
    for _ in range(3):
        router.started(1)
    # replica 1 has 3 in flight, the least loaded 0: over the threshold of 2 -> least loaded
    assert router.choose(system + [1, 2, 3, 4]) == 0  # 0 and 2 idle: 0's tree is smaller
    fresh = Router(2, RouterConfig(balance_threshold=2))
    fresh.record(1, system)
    fresh.started(1)
    fresh.started(1)
    assert fresh.choose(system + [5]) == 1  # 2 - 0 is within the threshold


def test_a_batch_goes_where_its_first_prompt_does_and_is_remembered_there_whole():
    router = Router(2, RouterConfig(balance_threshold=8))
    system = list(range(100, 120))
    router.record(1, system)
    batch = [system + [1], [7, 7, 7, 7], [8, 8, 8]]
    assert router.start_batch(batch) == 1  # the first prompt's longest match
    assert router.load == [0, 1]  # counted as started until `finished`
    # every prompt of the batch is in replica 1's tree now: each is routed there
    assert [router.choose(p + [0]) for p in batch[1:]] == [1, 1]
    router.finished(1)
    assert router.load == [0, 0]


def test_sessions_stick_and_round_robin_cycles():
    router = Router(2)
    router.record(1, [5, 5, 5, 5])
    assert router.choose([1, 2], session_id="a") == 0  # no match: the emptier tree
    assert router.choose([5, 5, 5, 5, 6], session_id="a") == 0  # sticks despite the match
    rr = Router(3, RouterConfig(policy="round_robin"))
    assert [rr.choose([1, 2, 3]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert [rr.choose([4], session_id="s") for _ in range(3)] == [1, 2, 0]  # no stickiness
    with pytest.raises(ValueError, match="RouterConfig.policy"):
        RouterConfig(policy="random")


@pytest.fixture(scope="module")
def replicas(tiny_hf_checkpoints, tmp_path_factory):
    directory = save_hf_model(
        make_hf_model("qwen2", vocab_size=97), tmp_path_factory.mktemp("router_model")
    )
    engines, handles = [], []
    for _ in range(2):
        engine = AsyncEngine(
            Engine(
                EngineConfig(
                    model_path=str(directory), page_size=4, kv_cache_tokens=16384, max_model_len=256
                )
            )
        )
        engines.append(engine)
        handles.append(start_server(build_app(engine, None, "tiny")))
    yield engines, [h.url for h in handles]
    for h, e in zip(handles, engines):
        h.stop()
        e.close()


def _run_sessions(urls, policy: str, seed: int) -> tuple[float, dict, object]:
    """5 sessions x 3 turns over the router (odd: round-robin moves every session each turn);
    each turn = previous prompt + completion + a new user chunk. Returns the hit rate on turns
    >= 2, the sessions' recorded turns, the router."""
    router = Router(2, RouterConfig(policy=policy))
    front = start_server(build_router_app(urls, router))
    rng = random.Random(seed)
    cached = total = 0
    served: dict[str, list] = {}
    try:
        with httpx.Client(base_url=front.url, timeout=120) as client:
            prompts = {f"{policy}-{s}": [rng.randrange(1, 97) for _ in range(24)] for s in range(5)}
            for turn in range(3):
                for sid, prompt in prompts.items():
                    r = client.post(
                        "/v1/completions",
                        headers={"X-Session-Id": sid},
                        json={
                            "model": "tiny",
                            "prompt": prompt,
                            "max_tokens": 6,
                            "seed": turn,
                            "ignore_eos": True,
                        },
                    ).json()
                    choice = r["choices"][0]
                    assert choice["logprobs"] is None  # recorded, not returned unasked
                    served.setdefault(sid, []).append(
                        (choice["prompt_token_ids"], choice["token_ids"], r["replica"])
                    )
                    if turn > 0:
                        cached += r["usage"]["prompt_tokens_details"]["cached_tokens"]
                        total += r["usage"]["prompt_tokens"]
                    prompts[sid] = (
                        prompt + choice["token_ids"] + [rng.randrange(1, 97) for _ in range(5)]
                    )
            recorded = {sid: client.get(f"/v1/sessions/{sid}").json() for sid in served}
            assert client.get("/v1/sessions/nope").status_code == 404
    finally:
        front.stop()
    for sid, turns in served.items():
        got = recorded[sid]["turns"]
        assert [(t["prompt_token_ids"], t["token_ids"], t["replica"]) for t in got] == turns
        assert all(
            len(t["logprobs"]) == len(t["token_ids"]) and t["weight_version"] == 0 for t in got
        )
    return cached / total, recorded, router


def test_cache_aware_sessions_hit_more_than_round_robin(replicas):
    _, urls = replicas
    aware, _, router = _run_sessions(urls, "cache_aware", seed=1)
    rr, _, _ = _run_sessions(urls, "round_robin", seed=2)
    assert router.load == [0, 0]
    assert sorted(set(router.sessions.values())) == [0, 1]  # balanced over both replicas
    assert aware > 0.7, aware
    assert aware > rr + 0.2, (aware, rr)
