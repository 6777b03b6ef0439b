"""Suffix lanes (persistent decode-suffix K/V, `rollout.suffix_lanes`) against the gather path.

* attention reading strided lanes (capacity past the width, stale finite values past the valid
  offsets) gives exactly the output of gathering the same suffix pages from the pool;
* an engine with lanes gives exactly the tokens and logprobs of one without, through random
  arrivals, aborts, preemption, eviction, forks and speculative drafts, and `check_integrity`
  (which compares every lane with the pool) holds after every step;
* past the memory bound the engine falls back to the gather path, with the same results.
"""

import random

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.attention import DecodeMetadata, _gather, cascade_decode_attention
from rollout.kv_pool import KVPool
from rollout.suffix_lanes import SuffixLanes


def test_attention_on_strided_lanes_equals_gather():
    g = torch.Generator().manual_seed(0)
    page, num_kv, heads, dim, num_pages = 4, 2, 4, 8, 40
    k_cache = torch.randn(num_kv, num_pages * page, dim, generator=g)
    v_cache = torch.randn(num_kv, num_pages * page, dim, generator=g)
    suffix_lens = [5, 1, 8, 3]  # this step's query included
    num_seqs, width = len(suffix_lens), 8
    perm = torch.randperm(num_pages, generator=g)
    suffix_pages = perm[: num_seqs * 2].view(num_seqs, 2)
    prefix_pages = perm[num_seqs * 2 : num_seqs * 2 + 3].view(1, 3)
    bias = torch.zeros(num_seqs, 1, width).masked_fill_(
        torch.arange(width) >= torch.tensor(suffix_lens).view(-1, 1, 1), float("-inf")
    )
    meta = DecodeMetadata(
        prefix_pages,
        torch.zeros(1, 3 * page),
        torch.arange(num_seqs),
        num_seqs,
        suffix_pages,
        bias,
        torch.arange(num_seqs),
        torch.arange(num_seqs),
    )
    q = torch.randn(num_seqs, heads, dim, generator=g)
    expected = cascade_decode_attention(q, k_cache, v_cache, meta, page)

    # Lanes: more lanes and positions than used, finite garbage past each valid length.
    lanes_k = torch.randn(num_kv, num_seqs + 3, width + 5, dim, generator=g)
    lanes_v = torch.randn(num_kv, num_seqs + 3, width + 5, dim, generator=g)
    gathered_k, gathered_v = (
        _gather(k_cache, suffix_pages, page),
        _gather(v_cache, suffix_pages, page),
    )
    for i, n in enumerate(suffix_lens):
        lanes_k[:, i, :n], lanes_v[:, i, :n] = gathered_k[:, i, :n], gathered_v[:, i, :n]
    views = lanes_k[:, :num_seqs, :width], lanes_v[:, :num_seqs, :width]
    got = cascade_decode_attention(q, k_cache, v_cache, meta, page, views)
    assert torch.equal(got, expected)


def _workload(rng: random.Random, vocab: int):
    shared = [[rng.randrange(vocab) for _ in range(rng.randint(3, 20))] for _ in range(3)]
    requests = []
    for i in range(30):
        prompt = rng.choice(shared) + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        params = SamplingParams(
            n=rng.choice([1, 2, 4]),
            temperature=rng.choice([0.0, 1.0]),
            max_new_tokens=rng.randint(1, 24),
            seed=100 + i,
            ignore_eos=True,
        )
        requests.append((prompt, params))
    return requests


def _drive(engine: Engine, seed: int, vocab: int) -> tuple[dict, int]:
    """Random arrivals and aborts (same for the same seed); outputs by request id, and the most
    lanes that held a sequence after any step."""
    rng = random.Random(seed)
    pending = _workload(rng, vocab)
    outputs, ids, most_lanes = {}, [], 0
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                ids.append(engine.add_request(*pending.pop(0)))
        if ids and rng.random() < 0.05:
            engine.abort(rng.choice(ids))
        for out in engine.step():
            outputs[out.request_id] = out
        engine.check_integrity()
        if engine.suffix_lanes is not None:
            most_lanes = max(most_lanes, len(engine.suffix_lanes.lane_of_epoch))
    return outputs, most_lanes


@pytest.mark.parametrize("page_size,speculative", [(1, None), (4, None), (4, "group")])
def test_engine_with_lanes_equals_gather_path(tiny_hf_checkpoints, page_size, speculative):
    # One thread: torch's CPU flash kernel splits its work by the thread count and the K/V
    # tensors' sizes, which the two paths lay out differently (a lane's capacity vs the
    # gathered history), so with two threads their float32 sums may round apart in the last
    # bit. Bitwise equality is a claim about one fixed split.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _lanes_vs_gather(tiny_hf_checkpoints, page_size, speculative)
    finally:
        torch.set_num_threads(threads)


def _lanes_vs_gather(tiny_hf_checkpoints, page_size, speculative):
    _, directory = tiny_hf_checkpoints("qwen2")
    results = {}
    for lanes in (True, False):
        engine = Engine(
            EngineConfig(
                model_path=str(directory),
                kv_cache_tokens=96,
                page_size=page_size,
                max_running_requests=12,
                max_prefill_tokens=24,
                speculative_method=speculative,
                decode_suffix_lanes=lanes,
            )
        )
        if (
            lanes
        ):  # the pool is tiny (to preempt often); lift the lanes' memory bound (tested below)
            engine.suffix_lanes.max_tokens = 1 << 20
        results[lanes] = _drive(engine, seed=page_size, vocab=97)
        stats = engine.stats()
        assert stats["preemptions"] > 0 and stats["running_sequences"] == 0
    (with_lanes, most_lanes), (without, _) = results[True], results[False]
    assert most_lanes >= 4, "lanes were hardly used: the test no longer exercises them"
    assert with_lanes.keys() == without.keys()
    aborted = 0
    for request_id, out in with_lanes.items():
        for a, b in zip(out.samples, without[request_id].samples):
            assert a == b, request_id  # tokens, logprobs (exactly) and finish reason
            aborted += a.finish_reason == "abort"
    assert aborted > 0


def test_memory_bound_falls_back_to_gather(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen2")
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7, ignore_eos=True)
    reference = Engine(
        EngineConfig(model_path=str(directory), page_size=4, decode_suffix_lanes=False)
    ).generate(prompts, params)
    engine = Engine(EngineConfig(model_path=str(directory), page_size=4))
    engine.suffix_lanes.max_tokens = 6 * 8  # 6 lanes of 8 positions, less than 12 new tokens need
    assert engine.generate(prompts, params) == reference
    assert engine.suffix_lanes.capacity <= 8 and not engine.suffix_lanes.lane_of_epoch


def test_plan_refuses_past_bound_and_forgets():
    pool = KVPool(
        num_layers=1,
        num_pages=8,
        page_size=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    lanes = SuffixLanes(pool, max_tokens=4)

    class Seq:  # the attributes `plan` reads, for a sequence about to decode its 9th suffix token
        num_tree_pages, num_computed, draft, kv_epoch, pages = 0, 8, [], 1, [0, 1, 2]

    assert lanes.plan([Seq()]) is None and lanes.k is None and not lanes.lane_of_epoch


def test_group_prefix_copies_follow_the_groups(tiny_hf_checkpoints):
    """Groups come and go while others keep decoding (mixed prefill + decode steps), each prompt
    as long as every other (so every group has the same number of prefix pages): the kept copies
    of the groups' prefix K/V must be re-gathered whenever the groups change. Exactly the tokens
    and log-probs of the gather path; `check_integrity` compares the copies with the pool."""
    _, directory = tiny_hf_checkpoints("qwen2")
    g = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, 97, (24, 9), generator=g).tolist()
    lengths = torch.randint(2, 16, (24,), generator=g).tolist()
    params = [
        SamplingParams(n=2, temperature=1.0, max_new_tokens=n, seed=i, ignore_eos=True)
        for i, n in enumerate(lengths)
    ]
    results = {}
    for lanes in (True, False):
        engine = Engine(
            EngineConfig(
                model_path=str(directory),
                page_size=4,
                max_running_requests=6,  # three groups at a time
                max_prefill_tokens=9,  # one prompt a step: groups join while others decode
                decode_suffix_lanes=lanes,
            )
        )
        for p, sp in zip(prompts, params):
            engine.add_request(p, sp)
        outs, steps_with_two_groups = {}, 0
        while engine.has_unfinished():
            for out in engine.step():
                outs[out.request_id] = out.samples
            engine.check_integrity()
            if lanes and engine.suffix_lanes._prefix_key is not None:
                steps_with_two_groups += len(engine.suffix_lanes._prefix_key) >= 2
        results[lanes] = outs
        if lanes:
            assert steps_with_two_groups > 10
    assert results[True] == results[False]


def test_growth_near_the_bound_keeps_the_lanes():
    """Doubling the capacity past the bound is capped at the bound instead of refused: lanes of
    3 sequences growing to 12 positions fit a bound of 3 x 12 (the doubling to 16 would not), so
    every step keeps its lanes (before the cap, the step at width 12 fell back to gathering)."""
    pool = KVPool(
        num_layers=1,
        num_pages=16,
        page_size=4,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device=torch.device("cpu"),
    )
    lanes = SuffixLanes(pool, max_tokens=3 * 12)

    class Seq:
        num_tree_pages, draft = 0, []

        def __init__(self, epoch: int, pages: list[int]):
            self.kv_epoch, self.pages, self.num_computed = epoch, pages, 0

    seqs = [Seq(i, [4 * i, 4 * i + 1, 4 * i + 2]) for i in range(3)]
    for computed in range(12):
        for s in seqs:
            s.num_computed = computed
        plan = lanes.plan(seqs)
        assert plan is not None, f"lanes dropped at {computed} computed tokens"
        assert lanes.capacity * 3 <= lanes.max_tokens and lanes.capacity >= plan.width
    assert lanes.capacity == 12 and sorted(lanes.lane_of_epoch) == [0, 1, 2]
    # A fourth sequence joins at the bound: the capacity shrinks to 36 // 4 = 8 >= the width
    # (short suffixes), keeping the valid offsets of the three lanes.
    for s in seqs:
        s.num_computed = 3
    lanes.plan(seqs)
    fourth = Seq(3, [12])
    plan = lanes.plan([*seqs, fourth])
    assert plan is not None and lanes.capacity == 8 and len(lanes.lanes) == 4
