"""Prefill-decode disaggregation against one engine doing both.

A prefill engine computes each prompt and samples every sample's first token
(`rollout.prefill_decode.prefill`); a decode engine admits the handoff (`Engine.admit_prefilled`)
and samples on. The reference is a single engine with the same weights and seeds
(`Engine.generate`): tokens, finish reasons and a mixture's routes equal, log-probs within 1e-12
in float64 (1e-5 in float32), for n = 1 and n > 1 (forks copying a partly filled page), cold and
with prefix-cache hits on the prefill side, the decode side, or both, with a decode engine
without a prefix cache, and with samples that end at their first token.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rollout import Engine, EngineConfig, SamplingParams
from rollout.prefill_decode import prefill, transfer

from tiny_hf import make_hf_model, save_hf_model

TOLERANCE = {"float32": 1e-5, "float64": 1e-12}
PREFIX = [3, 17, 5, 29, 11, 7, 23]  # 7 tokens: with page_size 4 a partly filled last page
PROMPTS = [PREFIX + [2, 41], PREFIX + [13], [43, 8, 61, 4, 9], PREFIX + [31, 19, 37]]
SAMPLED = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_new_tokens=9, seed=11)


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    made = {}
    for family in ("qwen2", "qwen3_moe"):
        model = make_hf_model(family, seed=0)
        made[family] = str(save_hf_model(model, tmp_path_factory.mktemp(family)))
    return made


def make_engine(directory: str, dtype: str, **overrides) -> Engine:
    kwargs = dict(model_path=directory, dtype=dtype, kv_cache_tokens=512, page_size=4, seed=0)
    return Engine(EngineConfig(**(kwargs | overrides)))


def disaggregated(prefill_engine: Engine, decode_engine: Engine, prompts, params):
    """Every prompt's RequestOutput from a prefill engine and a decode engine, in prompt order."""
    handoffs = prefill(prefill_engine, prompts, params)
    ids = [decode_engine.admit_prefilled(h, params) for h in handoffs]
    done = {}
    while decode_engine.has_unfinished():
        done.update((out.request_id, out) for out in decode_engine.step())
        decode_engine.check_integrity()
    prefill_engine.check_integrity()
    return [done[i] for i in ids], handoffs


def reference(engine: Engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step())
    return [done[i] for i in ids]


def assert_same(got, want, atol: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.prompt_token_ids == w.prompt_token_ids
        for gs, ws in zip(g.samples, w.samples, strict=True):
            assert gs.token_ids == ws.token_ids
            assert gs.finish_reason == ws.finish_reason
            assert len(gs.logprobs) == len(ws.logprobs)
            diff = max((abs(a - b) for a, b in zip(gs.logprobs, ws.logprobs)), default=0.0)
            assert diff <= atol, diff
        assert (g.routed_experts is None) == (w.routed_experts is None)
        if w.routed_experts is not None:
            for gr, wr in zip(g.routed_experts, w.routed_experts, strict=True):
                assert torch.equal(gr, wr)
        assert g.weight_versions == w.weight_versions


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("family", ["qwen2", "qwen3_moe"])
def test_disaggregated_equals_one_engine_cold_and_with_prefix_hits(family, dtype, checkpoints):
    directory = checkpoints[family]
    single = make_engine(directory, dtype)
    prefiller, decoder = make_engine(directory, dtype), make_engine(directory, dtype)
    atol = TOLERANCE[dtype]
    for params in (SAMPLED, SamplingParams(n=1, temperature=0.7, max_new_tokens=6, seed=5)):
        want = reference(single, PROMPTS, params)
        # Cold on both sides for the first params; the second round hits both prefix caches
        # (the prefill engine's own, and the decode engine's filled by the first handoffs).
        got, handoffs = disaggregated(prefiller, decoder, PROMPTS, params)
        assert_same(got, want, atol)
        assert [h.cached_tokens for h in handoffs] == [w.cached_tokens for w in want]
        # The decode engine keeps the transferred prompts: its cache holds them.
        assert decoder.stats()["prefix_cache_tokens"] > 0
    # Same seeds again: the prefill engine answers from its cache, the decode engine dedups.
    again, _ = disaggregated(prefiller, decoder, PROMPTS, SAMPLED)
    assert_same(again, reference(single, PROMPTS, SAMPLED), atol)


def test_decode_side_hit_with_a_cold_prefill_and_no_decode_cache(checkpoints):
    directory = checkpoints["qwen2"]
    single = make_engine(directory, "float64")
    want = reference(single, PROMPTS, SAMPLED)
    decoder = make_engine(directory, "float64")
    # Warm the decode engine's cache with the shared prefix through ordinary generation.
    reference(decoder, [PREFIX + [1]], SamplingParams(max_new_tokens=2, seed=1))
    hits_before = decoder.stats()["prefix_cache_hit_tokens"]
    got, _ = disaggregated(make_engine(directory, "float64"), decoder, PROMPTS, SAMPLED)
    assert_same(got, want, TOLERANCE["float64"])
    assert decoder.stats()["prefix_cache_tokens"] >= 4
    assert decoder.stats()["prefix_cache_hit_tokens"] > hits_before  # the forks' shares
    # Neither side caching: each sample gets its own copy of the prompt's K/V.
    uncached = dict(enable_prefix_cache=False)
    got, _ = disaggregated(
        make_engine(directory, "float64", **uncached),
        make_engine(directory, "float64", **uncached),
        PROMPTS,
        SAMPLED,
    )
    assert_same(got, want, TOLERANCE["float64"])


def test_samples_ending_at_their_first_token(checkpoints):
    directory = checkpoints["qwen2"]
    single = make_engine(directory, "float64")
    one = SamplingParams(n=2, max_new_tokens=1, seed=3)
    want = reference(single, PROMPTS, one)
    got, _ = disaggregated(
        make_engine(directory, "float64"), make_engine(directory, "float64"), PROMPTS, one
    )
    assert_same(got, want, TOLERANCE["float64"])
    assert all(s.finish_reason == "length" for out in got for s in out.samples)
    # A stop id that is some sample's first token: that sample stops at once, on both sides.
    first = want[0].samples[0].token_ids[0]
    stop = SamplingParams(n=3, max_new_tokens=8, seed=3, stop_token_ids=(first,))
    want = reference(single, PROMPTS, stop)
    got, _ = disaggregated(
        make_engine(directory, "float64"), make_engine(directory, "float64"), PROMPTS, stop
    )
    assert_same(got, want, TOLERANCE["float64"])
    assert any(s.finish_reason == "stop" and len(s.token_ids) == 1 for s in got[0].samples)


def test_handoff_payload_and_refusals(checkpoints):
    directory = checkpoints["qwen3_moe"]
    prefiller = make_engine(directory, "float32")
    (handoff,) = prefill(prefiller, [PROMPTS[0]], SAMPLED)
    pool = prefiller.pool
    layers, kv_heads, head_dim = pool.num_layers, pool.num_kv_heads, pool.head_dim
    prompt_len = len(PROMPTS[0])
    assert handoff.k.shape == (layers, kv_heads, prompt_len, head_dim)
    assert handoff.routes is not None and handoff.routes.shape[0] == prompt_len
    kv_bytes = 2 * layers * kv_heads * prompt_len * head_dim * 4
    assert handoff.nbytes == kv_bytes + handoff.routes.numel() * handoff.routes.element_size()
    assert len(handoff.first_tokens) == len(handoff.uniforms_taken) == SAMPLED.n
    assert all(t >= 1 for t in handoff.uniforms_taken)
    moved = transfer(handoff, "cpu")
    assert torch.equal(moved.k, handoff.k) and torch.equal(moved.v, handoff.v)

    decoder = make_engine(directory, "float32")
    with pytest.raises(ValueError, match="params.n=1"):
        decoder.admit_prefilled(handoff, SamplingParams(n=1, seed=11))
    with pytest.raises(ValueError, match="top_logprobs"):
        prefill(prefiller, [PROMPTS[0]], SamplingParams(top_logprobs=2))
    dense = checkpoints["qwen2"]
    drafting = make_engine(
        dense, "float32", speculative_method="draft", speculative_draft_model_path=dense
    )
    with pytest.raises(ValueError, match="speculative_method='draft'"):
        drafting.admit_prefilled(handoff, SAMPLED)
    halved = handoff._replace(k=handoff.k[:, :1], v=handoff.v[:, :1])  # one rank's heads only
    with pytest.raises(ValueError, match=f"K/V of 1 KV heads, .* model has {kv_heads}; "):
        decoder.admit_prefilled(halved, SAMPLED)
    decoder.update_weights([])  # a new weight version: the handoff's K/V is stale
    with pytest.raises(ValueError, match="weight version 0"):
        decoder.admit_prefilled(handoff, SAMPLED)


def test_decode_engine_short_of_pages_queues_and_preempts(checkpoints):
    """A decode engine with room for few sequences: handoffs wait in its queue until rows and
    pages free up, join a batch already decoding, are preempted and recomputed, and still
    sample what one roomy engine samples. An aborted handoff still queued ends at once."""
    directory = checkpoints["qwen3_moe"]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7, ignore_eos=True)
    prompts = [PREFIX + [i, i + 1] for i in range(1, 7)] + PROMPTS
    want = reference(make_engine(directory, "float64"), prompts, params)
    tight = dict(kv_cache_tokens=48, max_running_requests=4)
    decoder = make_engine(directory, "float64", **tight)
    handoffs = prefill(make_engine(directory, "float64"), prompts, params)
    ids, done = [], {}
    for h in handoffs:  # one arriving per step, into a running batch
        ids.append(decoder.admit_prefilled(h, params))
        done.update((out.request_id, out) for out in decoder.step())
        decoder.check_integrity()
    assert decoder.scheduler.prefilled, "the tight engine queued some handoffs"
    while decoder.has_unfinished():
        done.update((out.request_id, out) for out in decoder.step())
        decoder.check_integrity()
    assert decoder.stats()["preemptions"] > 0
    assert_same([done[i] for i in ids], want, TOLERANCE["float64"])

    busy = make_engine(directory, "float64", **tight)
    first = [busy.admit_prefilled(h, params) for h in handoffs[:4]]
    busy.step()
    queued = busy.admit_prefilled(handoffs[4], params)
    assert busy.scheduler.prefilled[-1][0].request_id == queued
    busy.abort(queued)
    outputs = {}
    while busy.has_unfinished():
        outputs.update((out.request_id, out) for out in busy.step())
        busy.check_integrity()
    assert [s.finish_reason for s in outputs[queued].samples] == ["abort", "abort"]
    assert_same([outputs[i] for i in first], want[:4], TOLERANCE["float64"])


@pytest.mark.parametrize("method", ["ngram", "group"])
def test_speculating_decode_engine(method, checkpoints):
    """A decode engine that speculates (n-gram proposals, exact verification) samples what one
    engine speculating alike samples; repeated prompts make the proposals hit. (A draft model
    would lack its own K/V of the prompt: refused, `test_handoff_payload_and_refusals`.)"""
    directory = checkpoints["qwen2"]
    spec = dict(speculative_method=method)
    prompts = [PREFIX * 3, [5, 6, 7, 8] * 4, PROMPTS[0]]
    for params in (
        SamplingParams(n=2, temperature=0.0, max_new_tokens=16, ignore_eos=True),
        SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=2, ignore_eos=True),
    ):
        want = reference(make_engine(directory, "float64", **spec), prompts, params)
        decoder = make_engine(directory, "float64", **spec)
        got, _ = disaggregated(make_engine(directory, "float64"), decoder, prompts, params)
        assert_same(got, want, TOLERANCE["float64"])
        assert decoder.stats()["spec_draft_tokens"] > 0


def test_multi_turn_sessions(checkpoints):
    """Each turn's prompt is the last turn's prompt and completion plus new tokens: the prefill
    engine reuses the earlier prompts it cached, and every turn samples what one engine serving
    the whole session samples."""
    directory = checkpoints["qwen3_moe"]
    single = make_engine(directory, "float64")
    prefiller, decoder = make_engine(directory, "float64"), make_engine(directory, "float64")
    sessions = [[3, 17, 5], [43, 8, 61, 4, 9, 2]]
    previous: list[list[int]] = [[], []]
    for turn in range(3):
        params = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=turn, ignore_eos=True)
        want = reference(single, sessions, params)
        got, handoffs = disaggregated(prefiller, decoder, sessions, params)
        assert_same(got, want, TOLERANCE["float64"])
        # The prefill engine never saw the completions: it holds the earlier prompts' whole
        # pages only (the decode engine holds the whole turns).
        assert [h.cached_tokens for h in handoffs] == [len(p) // 4 * 4 for p in previous]
        previous = sessions
        sessions = [s + out.samples[0].token_ids + [11 + turn] for s, out in zip(sessions, want)]
    assert decoder.stats()["prefix_cache_tokens"] >= 8


def _decode_in_child(directory: str, params: SamplingParams, inbox, outbox) -> None:
    decoder = make_engine(directory, "float64")
    handoffs = inbox.get()  # tensors arrive in shared memory, not copied through the pipe
    shared = all(h.k.is_shared() and h.v.is_shared() for h in handoffs)
    ids = [decoder.admit_prefilled(h, params) for h in handoffs]
    done = {}
    while decoder.has_unfinished():
        done.update((out.request_id, out) for out in decoder.step())
    outbox.put((shared, [[tuple(s) for s in done[i].samples] for i in ids]))


def test_handoff_to_another_process_through_shared_memory(checkpoints):
    """The decode engine in another process: the handoffs travel through a
    `torch.multiprocessing` queue (their tensors in CPU shared memory) and the child decodes
    what one engine samples."""
    directory = checkpoints["qwen2"]
    want = reference(make_engine(directory, "float64"), PROMPTS, SAMPLED)
    handoffs = prefill(make_engine(directory, "float64"), PROMPTS, SAMPLED)
    context = torch.multiprocessing.get_context("fork")
    inbox, outbox = context.Queue(), context.Queue()
    child = context.Process(target=_decode_in_child, args=(directory, SAMPLED, inbox, outbox))
    child.start()
    try:
        inbox.put(handoffs)
        shared, samples = outbox.get(timeout=120)
    finally:
        child.join(timeout=30)
    assert child.exitcode == 0
    assert shared
    for got, out in zip(samples, want, strict=True):
        for (tokens, logprobs, reason, _), s in zip(got, out.samples, strict=True):
            assert tokens == s.token_ids and reason == s.finish_reason
            assert max(abs(a - b) for a, b in zip(logprobs, s.logprobs)) <= 1e-12


def test_async_engines_prefill_and_decode_as_one_engine(checkpoints):
    """Through two `AsyncEngine`s (the engine actors' path): `submit_prefill` resolves with the
    handoffs, `submit_prefilled` with what one engine samples; a decode engine at another weight
    version refuses a handoff (nothing is served across a version boundary)."""
    from rollout.async_engine import AsyncEngine
    from rollout.handoff import StaleHandoff

    directory = checkpoints["qwen2"]
    want = reference(make_engine(directory, "float64"), PROMPTS, SAMPLED)
    prefiller = AsyncEngine(make_engine(directory, "float64"))
    decoder = AsyncEngine(make_engine(directory, "float64"))
    try:
        futures = prefiller.submit_prefill([(p, SAMPLED) for p in PROMPTS])
        handoffs = [f.result(timeout=120) for f in futures]
        assert [h.prompt_token_ids for h in handoffs] == [tuple(p) for p in PROMPTS]
        futures = decoder.submit_prefilled([(h, SAMPLED) for h in handoffs])
        results = [f.result(timeout=120) for f in futures]
        assert_same([_as_output(r) for r in results], want, TOLERANCE["float64"])
        assert all(r.weight_version == 0 for r in results)
        decoder.engine.weight_version += 1
        (refused,) = decoder.submit_prefilled([(handoffs[0], SAMPLED)])
        # StaleHandoff (a ValueError): the caller knows to prefill it again
        with pytest.raises(StaleHandoff, match="prefilled at weight version 0"):
            refused.result(timeout=120)
    finally:
        prefiller.close()
        decoder.close()


def _as_output(result):
    """A `GenerationResult` read as the `RequestOutput` fields `assert_same` compares."""
    from types import SimpleNamespace

    return SimpleNamespace(
        prompt_token_ids=result.prompt_token_ids,
        samples=result.samples,
        routed_experts=result.routed_experts,
        weight_versions=result.sample_versions,
    )


def test_in_place_continuations_decode_where_their_kv_is_parked(checkpoints):
    """Over-sampling's `partial: in_place` under prefill-decode, through `AsyncEngine`s: a first
    batch of groups with a quota (the rest aborted, their K/V parked on the decode engine), a
    weight update, then a second batch of the carried samples' continuations and fresh groups.
    The continuations go to the decode engine as prompt ids (`submit_prefilled`): it adopts its
    parked K/V (nothing re-sent), one step ahead of the prefilled fresh groups. Every request's
    tokens, log-probs and finish reasons, the groups completing within the quota (in order) and
    the parked tokens reused equal one engine doing both."""
    from rollout.async_engine import AsyncEngine

    directory = checkpoints["qwen2"]
    weights = list(load_file(str(Path(directory) / "model.safetensors")).items())

    def params(max_new: int, seed: int, n: int = 2) -> SamplingParams:
        return SamplingParams(
            n=n, temperature=1.0, max_new_tokens=max_new, seed=seed, ignore_eos=True, park_kv=True
        )

    first = [(p, params(m, 7 + g)) for g, (p, m) in enumerate(zip(PROMPTS, [3, 14, 5, 14]))]
    first.append(([43, 8, 61], params(9, 12)))  # cut mid-way: its samples are carried

    def continuations(results) -> list:
        """Group g's unfinished samples, each its own request (prompt + tokens, n = 1)."""
        out = []
        for g, (result, (prompt, p)) in enumerate(zip(results, first)):
            for j, s in enumerate(result.samples):
                if s.finish_reason == "abort":
                    left = p.max_new_tokens - len(s.token_ids)
                    cont = dataclasses.replace(p, n=1, seed=p.seed + j, max_new_tokens=left)
                    out.append((g, list(prompt) + list(s.token_ids), cont))
        return out

    fresh = [([5, 9, 13, 2, 7, 3], params(2, 21)), ([8, 61, 3], params(12, 22))]

    def one_engine():
        engine = AsyncEngine(make_engine(directory, "float64"))
        try:
            futures = engine.submit_many(first, groups=[0, 1, 2, 3, 4], quota=2)
            done1 = AsyncEngine.complete_groups(futures).result(timeout=120)
            results1 = [f.result(timeout=120) for f in futures]
            engine.pause()
            engine.engine.update_weights(weights)
            engine.resume()
            conts = continuations(results1)
            requests = [(prompt, p) for _, prompt, p in conts] + fresh
            groups = [g for g, _, _ in conts] + [5, 6]
            before = engine.stats()["parked_reused_tokens"]
            futures = engine.submit_many(requests, groups=groups, quota=2)
            done2 = AsyncEngine.complete_groups(futures).result(timeout=120)
            results2 = [f.result(timeout=120) for f in futures]
            reused = engine.stats()["parked_reused_tokens"] - before
        finally:
            engine.close()
        return results1, done1, results2, done2, reused

    def prefill_decode():
        prefiller = AsyncEngine(make_engine(directory, "float64"))
        decoder = AsyncEngine(make_engine(directory, "float64"))
        try:
            handoffs = [f.result(timeout=120) for f in prefiller.submit_prefill(first)]
            requests = [(h, p) for h, (_, p) in zip(handoffs, first)]
            futures = decoder.submit_prefilled(requests, groups=[0, 1, 2, 3, 4], quota=2)
            done1 = AsyncEngine.complete_groups(futures).result(timeout=120)
            results1 = [f.result(timeout=120) for f in futures]
            for engine in (prefiller, decoder):
                engine.pause()
                engine.engine.update_weights(weights)
                engine.resume()
            handoffs = [f.result(timeout=120) for f in prefiller.submit_prefill(fresh)]
            conts = continuations(results1)
            requests = [(prompt, p) for _, prompt, p in conts]
            requests += [(h, p) for h, (_, p) in zip(handoffs, fresh)]
            groups = [g for g, _, _ in conts] + [5, 6]
            before = decoder.stats()["parked_reused_tokens"]
            futures = decoder.submit_prefilled(requests, groups=groups, quota=2)
            done2 = AsyncEngine.complete_groups(futures).result(timeout=120)
            results2 = [f.result(timeout=120) for f in futures]
            reused = decoder.stats()["parked_reused_tokens"] - before
            decoder.engine.check_integrity()
        finally:
            prefiller.close()
            decoder.close()
        return results1, done1, results2, done2, reused

    want, got = one_engine(), prefill_decode()
    for w, g in ((want[0], got[0]), (want[2], got[2])):
        assert_same([_as_output(r) for r in g], [_as_output(r) for r in w], TOLERANCE["float64"])
    assert got[1] == want[1] and got[3] == want[3]  # the same groups complete, in order
    assert got[4] == want[4] > 0  # the parked tokens adopted, not prefilled again
    assert len(continuations(want[0])) >= 2  # samples were carried
    # some continuations and fresh groups were cut by the second quota, too
    assert any(s.finish_reason == "abort" for r in want[2] for s in r.samples)


def test_a_quota_met_before_the_prefilled_requests_are_admitted(checkpoints):
    """The decode engine's own request completes its group in the step before the prefilled
    ones are admitted, meeting the quota: they are admitted and cut at once, ending with their
    first token (their K/V parked), as one engine cuts them after the step that sampled it."""
    from rollout.async_engine import AsyncEngine

    directory = checkpoints["qwen2"]
    own = SamplingParams(n=1, temperature=1.0, max_new_tokens=1, seed=3, park_kv=True)
    cut = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=4, park_kv=True)
    own_prompt, fresh_prompt = PROMPTS[0] + [9, 4], PROMPTS[2]

    single = AsyncEngine(make_engine(directory, "float64"))
    prefiller = AsyncEngine(make_engine(directory, "float64"))
    decoder = AsyncEngine(make_engine(directory, "float64"))
    try:
        requests = [(own_prompt, own), (fresh_prompt, cut)]
        futures = single.submit_many(requests, groups=[0, 1], quota=1)
        want = [f.result(timeout=120) for f in futures]
        (handoff,) = [f.result(timeout=120) for f in prefiller.submit_prefill([requests[1]])]
        futures = decoder.submit_prefilled(
            [(own_prompt, own), (handoff, cut)], groups=[0, 1], quota=1
        )
        assert AsyncEngine.complete_groups(futures).result(timeout=120) == [0]
        got = [f.result(timeout=120) for f in futures]
        assert_same([_as_output(r) for r in got], [_as_output(r) for r in want], 1e-12)
        assert [len(s.token_ids) for s in got[1].samples] == [1, 1]
        assert [s.finish_reason for s in got[1].samples] == ["abort", "abort"]
        parked = decoder.engine.scheduler.parked
        assert sorted(p.tokens for p in parked) == sorted(
            tuple(fresh_prompt) + tuple(s.token_ids) for s in want[1].samples
        )
        decoder.engine.check_integrity()
    finally:
        for engine in (single, prefiller, decoder):
            engine.close()


def test_a_decode_engine_tells_what_its_cache_holds_for_the_next_turn(checkpoints):
    """Conditional disaggregation asks a decode engine how much of each later turn its prefix
    cache holds (`Engine.cached_prefix_lengths`): the answer is the radix cache's own match (of
    an engine with the same history), it is what the next turn then takes from the cache when
    prefilled there, completions included (which the prefill engine never saw), and asking
    changes nothing: an engine asked and one never asked serve the next turn alike."""
    directory = checkpoints["qwen2"]
    asked, quiet, matcher = (make_engine(directory, "float64") for _ in range(3))
    sessions = [[3, 17, 5, 29, 11], [43, 8, 61, 4, 9, 2, 7]]
    params = SamplingParams(n=1, temperature=1.0, max_new_tokens=6, seed=3, ignore_eos=True)
    for decoder in (asked, quiet, matcher):
        first, _ = disaggregated(make_engine(directory, "float64"), decoder, sessions, params)
    later = [s + out.samples[0].token_ids + [13, 2] for s, out in zip(sessions, first)]
    probes = [*later, sessions[0][:3] + [99, 98, 97], [50, 51, 52, 53, 54]]  # mid-edge, none
    lengths = asked.cached_prefix_lengths(probes)
    assert asked.cached_prefix_lengths(probes) == lengths
    assert lengths == [matcher.scheduler.cache.match_prefix(p[:-1]).num_tokens for p in probes]
    assert lengths[0] > len(sessions[0])  # the completion's K/V is there
    assert lengths[-1] == 0
    got, want = reference(asked, later, params), reference(quiet, later, params)
    assert_same(got, want, 0.0)
    assert [o.cached_tokens for o in got] == [o.cached_tokens for o in want] == lengths[:2]
    assert asked.stats() | {"busy_s": 0} == quiet.stats() | {"busy_s": 0}
