"""Weight updates while requests run (`Engine.update_weights(keep_running=True)`, `in_place`).

* the same weights loaded mid-generation change nothing (tokens, log-probs, exactly) but the
  per-token versions: tokens sampled after the update carry the new version;
* new weights at a known step: the tokens before it equal the undisturbed run's, and the
  log-probs after it equal HF transformers (exact float64) that built its KV cache with the old
  weights over the tokens computed before the update, then continued with the new weights;
* the prefix cache never serves pre-update pages to a request admitted after the update (the
  tree the running requests hold is retired; they never insert into the new one), and the
  retired pages are freed once their last holder finishes;
* the same through `AsyncEngine.update_weights_between_steps`, from another thread.
"""

import dataclasses
import threading
import time

import pytest
import torch
from exact_float64 import exact_float64

from rollout import Engine, EngineConfig, SamplingParams
from rollout.async_engine import AsyncEngine
from rollout.weights import iter_safetensors

from tiny_hf import make_hf_model, save_hf_model

PROMPTS = [[5, 9, 2, 7, 11, 3, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12]]
SAMPLED = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7, ignore_eos=True)
UPDATE_AFTER = 5  # engine steps before the update: prefill (1) + 4 decodes
ATOL = 1e-10  # float64 engine vs exact-float64 HF


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    """(HF float64 model in exact float64, its directory, new weights by HF name)."""
    hf = make_hf_model("qwen2", seed=0, dtype=torch.float64)
    directory = save_hf_model(hf, tmp_path_factory.mktemp("inplace64"))
    g = torch.Generator().manual_seed(1)
    new = {
        n: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype)
        for n, t in iter_safetensors(directory)
    }
    return exact_float64(hf), directory, new


def _engine(directory, **kw) -> Engine:
    return Engine(EngineConfig(model_path=str(directory), dtype="float64", page_size=2, **kw))


def _run(engine: Engine, update=None, after: int = UPDATE_AFTER):
    """Generate PROMPTS with SAMPLED, stepping by hand; `update(engine)` runs between step
    `after` and the next. Returns (outputs by request id, generated counts at the update)."""
    ids = [engine.add_request(p, SAMPLED) for p in PROMPTS]
    outs, steps, at_update = {}, 0, {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
        steps += 1
        if steps == after and update is not None:
            at_update = {
                (s.request.request_id, s.sample_index): s.num_generated
                for s in engine.scheduler.running
            }
            update(engine)
            engine.check_integrity()
    return [outs[i] for i in ids], at_update


def test_same_weights_mid_generation_change_nothing_but_versions(model64):
    _, directory, _ = model64
    expected, _ = _run(_engine(directory))
    same = list(iter_safetensors(directory))
    engine = _engine(directory)
    got, at_update = _run(engine, lambda e: e.update_weights(same, keep_running=True))
    assert len(at_update) == 4  # every sample was mid-generation at the update
    # the K/V kept: each sample's prompt and its tokens but the pending (last sampled) one
    kept = sum(len(PROMPTS[rid]) + generated - 1 for (rid, _), generated in at_update.items())
    assert engine.stats()["in_place_kept_tokens"] == kept
    for want, out in zip(expected, got):
        assert out.samples == want.samples  # tokens, log-probs, finish reasons: exactly
        assert all(v == [0] * len(s.token_ids) for v, s in zip(want.weight_versions, want.samples))
    for out in got:
        for j, (s, versions) in enumerate(zip(out.samples, out.weight_versions)):
            before = at_update[out.request_id, j]
            assert 0 < before < len(s.token_ids)
            assert versions == [0] * before + [1] * (len(s.token_ids) - before)


def test_new_weights_mid_generation_continue_from_the_old_kv(model64):
    hf, directory, new = model64
    expected, _ = _run(_engine(directory))
    got, at_update = _run(
        _engine(directory), lambda e: e.update_weights(new.items(), keep_running=True)
    )
    old_state = {k: v.clone() for k, v in hf.state_dict().items()}
    try:
        worst = 0.0
        for prompt, want, out in zip(PROMPTS, expected, got):
            for j, (w, s) in enumerate(zip(want.samples, out.samples)):
                k = at_update[out.request_id, j]  # tokens sampled by the old weights
                assert s.token_ids[:k] == w.token_ids[:k]
                assert s.logprobs[:k] == w.logprobs[:k]
                assert out.weight_versions[j] == [0] * k + [1] * (len(s.token_ids) - k)
                assert s.token_ids[k:] != w.token_ids[k:]  # the new weights did sample
                # The engine had computed K/V for prompt + the first k-1 tokens (token k was
                # pending): HF builds that cache with the old weights ...
                hf.load_state_dict(old_state)
                ids = torch.tensor([prompt + s.token_ids])
                with torch.no_grad():
                    past = hf(ids[:, : len(prompt) + k - 1], use_cache=True).past_key_values
                    # ... and continues from it with the new ones over the same tokens.
                    hf.load_state_dict({**old_state, **new})
                    logits = hf(ids[:, len(prompt) + k - 1 : -1], past_key_values=past).logits
                lp = torch.log_softmax(logits[0].double(), -1)
                ref = lp[torch.arange(lp.shape[0]), torch.tensor(s.token_ids[k:])]
                got_lp = torch.tensor(s.logprobs[k:], dtype=torch.float64)
                worst = max(worst, (got_lp - ref).abs().max().item())
                # not the same as recomputing everything with the new weights (retract)
                with torch.no_grad():
                    full = torch.log_softmax(hf(ids).logits[0, len(prompt) + k - 1 : -1], -1)
                recomputed = full[torch.arange(full.shape[0]), torch.tensor(s.token_ids[k:])]
                assert (got_lp - recomputed).abs().max().item() > 1e-6
        assert worst <= ATOL, f"max |engine - HF old-KV continuation| = {worst:.3g}"
    finally:
        hf.load_state_dict(old_state)


def test_prefix_cache_never_serves_pre_update_pages(model64):
    hf, directory, new = model64
    engine = _engine(directory)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    # A finished request leaves its pages cached (unlocked); a running one holds its own.
    engine.generate([PROMPTS[1]], greedy)
    running = engine.add_request(PROMPTS[0], greedy)
    for _ in range(3):
        engine.step()
    old = engine.scheduler.cache
    assert old.locked_pages > 0 and old.evictable_pages > 0
    engine.update_weights(new.items(), keep_running=True)
    engine.check_integrity()
    assert engine.scheduler.cache.cached_pages == 0  # a fresh tree; the unlocked pages freed
    assert engine.scheduler.allocator.retired_caches == [old] and old.evictable_pages == 0
    # Pages that still hold old-weight K/V: the running request's (freed ones get rewritten).
    old_pages = {p for n in old._nodes() for p in n.pages}
    old_pages |= {p for s in engine.scheduler.running for p in s.pages}
    hit_before = engine.stats()["prefix_cache_hit_tokens"]
    fresh = [engine.add_request(p, greedy) for p in PROMPTS]  # both prompts were cached
    outs = {}
    while engine.has_unfinished():
        for seq in engine.scheduler.running:
            if seq.request.request_id in fresh:
                assert not old_pages & set(seq.pages)
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
    assert [outs[i].cached_tokens for i in fresh] == [0, 0]
    # The fresh requests' forks hit only their own new prompt pages (none of the old ones).
    assert engine.stats()["prefix_cache_hit_tokens"] == hit_before
    # The running request finished without offering its mixed-weight K/V to the new cache,
    # and the retired tree's pages went back to the pool.
    assert all(t.cached_pages == 0 for t in engine.scheduler.allocator.retired_caches)
    tokens = PROMPTS[0] + outs[running].samples[0].token_ids
    probe = engine.add_request(tokens, SamplingParams(max_new_tokens=1))
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
    # Only the prompt pages the fresh request computed with the new weights are shared.
    assert outs[probe].cached_tokens == len(PROMPTS[0]) // 2 * 2
    # The fresh requests equal HF with the new weights.
    old_state = {k: v.clone() for k, v in hf.state_dict().items()}
    try:
        hf.load_state_dict({**old_state, **new})
        for prompt, i in zip(PROMPTS, fresh):
            s = outs[i].samples[0]
            ids = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                lp = torch.log_softmax(hf(ids).logits[0, len(prompt) - 1 : -1].double(), -1)
            assert s.token_ids == lp.argmax(-1).tolist()
            ref = lp[torch.arange(lp.shape[0]), torch.tensor(s.token_ids)]
            assert (torch.tensor(s.logprobs, dtype=torch.float64) - ref).abs().max() <= ATOL
    finally:
        hf.load_state_dict(old_state)


def test_async_update_between_steps_keeps_requests(model64):
    _, directory, _ = model64
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=48, seed=3, ignore_eos=True)
    expected = _engine(directory).generate(PROMPTS, params)
    engine = _engine(directory)
    front = AsyncEngine(engine)
    try:
        futures = front.submit_many([(p, params) for p in PROMPTS])
        deadline = time.monotonic() + 60
        while engine.stats()["generated_tokens"] < 8 and time.monotonic() < deadline:
            time.sleep(0.001)
        versions = []
        worker = threading.Thread(
            target=lambda: versions.append(
                front.update_weights_between_steps(list(iter_safetensors(directory)))
            )
        )
        worker.start()
        worker.join(60)
        results = [f.result(60) for f in futures]
    finally:
        front.close()
    assert versions == [1]
    assert [r.samples for r in results] == expected
    mixed = 0
    for r in results:
        assert r.weight_version == 1
        for s, v in zip(r.samples, r.sample_versions):
            assert len(v) == len(s.token_ids) and v == sorted(v) and set(v) <= {0, 1}
            mixed += len(set(v)) == 2
    assert mixed > 0, "the update landed after every sample had finished"


def test_step_refused_between_load_and_commit(model64):
    _, directory, new = model64
    engine = _engine(directory)
    engine.add_request(PROMPTS[0], SAMPLED)
    engine.step()
    engine.load_weights(list(new.items())[:2], keep_running=True)
    with pytest.raises(RuntimeError, match="commit_weights"):
        engine.step()
    engine.commit_weights()
    engine.step()
    with pytest.raises(RuntimeError, match="in flight"):
        engine.update_weights(new.items())  # without keep_running an engine must be idle


def _hf_continuation(hf, new, prompt, tokens, computed):
    """Log-probs of tokens[computed - len(prompt) + 1:] by HF: K/V of (prompt + tokens)[:computed]
    from the current weights, the rest with `new` (HF state restored afterwards)."""
    old_state = {k: v.clone() for k, v in hf.state_dict().items()}
    ids = torch.tensor([prompt + tokens])
    try:
        with torch.no_grad():
            past = hf(ids[:, :computed], use_cache=True).past_key_values
            hf.load_state_dict({**old_state, **new})
            logits = hf(ids[:, computed:-1], past_key_values=past).logits
    finally:
        hf.load_state_dict(old_state)
    lp = torch.log_softmax(logits[0].double(), -1)
    return lp[torch.arange(lp.shape[0]), torch.tensor(tokens[computed - len(prompt) + 1 :])]


def _finish(engine, ids):
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
    return [outs[i] for i in ids]


def test_parked_kv_survives_an_idle_update_and_is_adopted_by_its_continuation(model64):
    """`rollout.partial: in_place` on a synchronous loop: aborted, parked, weights updated with
    the engine idle, continued with the old K/V."""
    hf, directory, new = model64
    engine = _engine(directory)
    parked = SamplingParams(n=2, max_new_tokens=12, seed=5, ignore_eos=True, park_kv=True)
    rid = engine.add_request(PROMPTS[1], parked)
    for _ in range(UPDATE_AFTER):
        engine.step()
    engine.abort(rid)
    (out,) = _finish(engine, [rid])
    assert [s.finish_reason for s in out.samples] == ["abort", "abort"]
    assert len(engine.scheduler.parked) == 2
    engine.update_weights(new.items())  # idle: nothing in flight, the parked K/V stays
    engine.check_integrity()
    assert engine.stats()["parked_kv_tokens"] > 0
    # A request without park_kv, same tokens: never given the old K/V.
    tokens0 = PROMPTS[1] + out.samples[0].token_ids
    (plain,) = _finish(engine, [engine.add_request(tokens0, SamplingParams(max_new_tokens=1))])
    assert plain.cached_tokens == 0
    more = SamplingParams(max_new_tokens=6, seed=9, ignore_eos=True, park_kv=True)
    reused = engine.stats()["parked_reused_tokens"]
    conts = _finish(
        engine, [engine.add_request(PROMPTS[1] + s.token_ids, more) for s in out.samples]
    )
    assert engine.stats()["parked_reused_tokens"] - reused == sum(
        len(PROMPTS[1]) + len(s.token_ids) - 1 for s in out.samples
    )
    assert not engine.scheduler.parked
    worst = 0.0
    for s, c in zip(out.samples, conts):
        tokens = s.token_ids + c.samples[0].token_ids
        computed = len(PROMPTS[1]) + len(s.token_ids) - 1
        ref = _hf_continuation(hf, new, PROMPTS[1], tokens, computed)
        got = torch.tensor(c.samples[0].logprobs, dtype=torch.float64)
        worst = max(worst, (got - ref).abs().max().item())
        assert c.weight_versions[0] == [1] * len(c.samples[0].token_ids)
    assert worst <= ATOL, f"max |engine - HF old-KV continuation| = {worst:.3g}"


def test_parked_kv_gives_way_to_memory_pressure(model64):
    hf, directory, _ = model64
    engine = _engine(directory, kv_cache_tokens=48, max_running_requests=4)
    parked = SamplingParams(max_new_tokens=12, seed=5, ignore_eos=True, park_kv=True)
    rid = engine.add_request(PROMPTS[0], parked)
    for _ in range(4):
        engine.step()
    engine.abort(rid)
    (out,) = _finish(engine, [rid])
    held = engine.stats()["parked_kv_tokens"]
    assert held > 0
    # A request that needs (nearly) the whole pool: the parked K/V is dropped, not a stall.
    big = SamplingParams(max_new_tokens=40 - len(PROMPTS[1]), seed=1, ignore_eos=True)
    _finish(engine, [engine.add_request(PROMPTS[1], big)])
    assert engine.stats()["parked_dropped_tokens"] == held and not engine.scheduler.parked
    # The continuation then prefills everything again (what retract does): HF's plain forward.
    tokens = PROMPTS[0] + out.samples[0].token_ids
    more = dataclasses.replace(parked, max_new_tokens=4)
    (cont,) = _finish(engine, [engine.add_request(tokens, more)])
    assert engine.stats()["parked_reused_tokens"] == 0
    s = cont.samples[0]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([tokens + s.token_ids])).logits[0].double(), -1)
    lp = lp[len(tokens) - 1 : -1]
    ref = lp[torch.arange(lp.shape[0]), torch.tensor(s.token_ids)]
    assert (torch.tensor(s.logprobs, dtype=torch.float64) - ref).abs().max() <= ATOL
