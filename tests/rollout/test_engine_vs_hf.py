"""The rollout engine against Hugging Face transformers.

HF transformers is the independent reference: the tiny random-init checkpoints of
`tests/tiny_hf.py` (Qwen2, Qwen3, Llama; fp32) are loaded both by HF and by our engine, and
the engine's greedy tokens, logprobs, seeded sampling, sampling distribution, prefix reuse,
weight updates, memory release and finish reasons are checked against HF or against the
documented contract:

* greedy decoding (temperature 0) equals HF `generate(do_sample=False)` run per prompt
  (batch 1, no padding), whatever the batch, the prefix cache, the page size, chunked prefill
  or preemption;
* the logprob of each returned token equals HF's `log_softmax(logits / T)` of that token
  (T = 1 when greedy), before top-p / top-k truncation, within 1e-5;
* sample j of a request with `seed=s` draws from its own generator seeded with `s + j`;
* sampling draws from HF's truncated distribution: HF's warpers in `generate`'s order
  (temperature, top-k, then top-p over the renormalised top-k distribution, then min-p),
  checked by a chi-square test on 4000 draws.

Greedy equality is exact only when the reference argmax is well defined under fp32 rounding,
so greedy reference prompts are drawn until HF's top-1 / top-2 logit gap is >= 1e-3 at every
generated step (`_decisive_prompt`); the check itself is exact token equality.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil

import pytest
import torch
import transformers
from safetensors.torch import load_file

from rollout import Engine, EngineConfig, SamplingParams

from tiny_hf import FAMILIES, make_hf_model, save_hf_model

FAMILY_LIST = list(FAMILIES)
LOGPROB_ATOL = 1e-5
GREEDY_MARGIN = 1e-3  # smallest HF top-1 / top-2 logit gap accepted in a greedy reference
CHI2_P_MIN = 0.001  # reject the sampler if the chi-square p-value is below this

GREEDY = dict(temperature=0.0, ignore_eos=True)


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """The models are tiny: one intra-op thread is fastest, and it avoids OpenMP spin-waiting
    (milliseconds per tiny matmul) when other processes share the cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def make_engine(directory, **overrides) -> Engine:
    kwargs = dict(
        model_path=str(directory),
        device="cpu",
        dtype="float32",
        kv_cache_tokens=4096,
        page_size=1,
        enable_prefix_cache=True,
        seed=0,
    )
    kwargs.update(overrides)
    return Engine(EngineConfig(**kwargs))


def tokens(outs) -> list[list[list[int]]]:
    return [[list(s.token_ids) for s in per_prompt] for per_prompt in outs]


_HF_GREEDY_CACHE: dict[tuple, tuple[list[int], float]] = {}


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], float]:
    """HF greedy continuation of one prompt (batch 1, no padding, EOS ignored) and the
    smallest top-1 / top-2 logit gap along it."""
    key = (id(model), tuple(prompt), max_new_tokens)
    if key not in _HF_GREEDY_CACHE:
        ids = torch.tensor([prompt])
        # eos_token_id=[] (not None, which falls back to the model's EOS) never stops early.
        gc = transformers.GenerationConfig(
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=[],
            bos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)
        new = out.sequences[0, len(prompt) :].tolist()
        assert len(new) == max_new_tokens, "HF reference stopped early; EOS must be ignored"
        top2 = torch.stack(out.scores)[:, 0].topk(2, dim=-1).values
        _HF_GREEDY_CACHE[key] = (new, float((top2[:, 0] - top2[:, 1]).min()))
    return _HF_GREEDY_CACHE[key]


def _decisive_prompt(
    model, rng: random.Random, length: int, max_new_tokens: int, prefix: list[int] = ()
) -> list[int]:
    vocab = model.config.vocab_size
    for _ in range(200):
        prompt = list(prefix) + [rng.randrange(vocab) for _ in range(length - len(prefix))]
        if hf_greedy(model, prompt, max_new_tokens)[1] >= GREEDY_MARGIN:
            return prompt
    raise AssertionError("no prompt with a decisive HF greedy continuation found")


_PROMPT_SETS: dict[tuple, list[list[int]]] = {}


def greedy_prompts(model, family: str, max_new_tokens: int) -> list[list[int]]:
    """Prompts of different lengths (1 to 30), two sharing a 15-token prefix and one repeated,
    each with a decisive HF greedy continuation."""
    key = (family, max_new_tokens)
    if key not in _PROMPT_SETS:
        rng = random.Random(1000 + FAMILY_LIST.index(family))
        prompts = [_decisive_prompt(model, rng, n, max_new_tokens) for n in (1, 6, 13, 21, 30, 9)]
        prompts.append(_decisive_prompt(model, rng, 19, max_new_tokens, prefix=prompts[3][:15]))
        prompts.append(list(prompts[2]))
        _PROMPT_SETS[key] = prompts
    return _PROMPT_SETS[key]


@torch.inference_mode()
def hf_logprobs(
    model, prompt: list[int], completion: list[int], temperature: float
) -> torch.Tensor:
    """HF's log_softmax(logits / T) of each completion token (T = 1 for greedy)."""
    t = 1.0 if temperature == 0.0 else temperature
    seq = torch.tensor([list(prompt) + list(completion)])
    logits = model(seq).logits[0, len(prompt) - 1 : len(prompt) - 1 + len(completion)].double()
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(-1, torch.tensor(completion).view(-1, 1)).view(-1)


@torch.inference_mode()
def hf_next_logits(model, prompt: list[int]) -> torch.Tensor:
    return model(torch.tensor([prompt])).logits[0, -1].double()


def run_until_done(engine: Engine) -> dict[int, object]:
    done = {}
    for _ in range(10_000):
        if not engine.has_unfinished():
            return done
        for out in engine.step():
            done[out.request_id] = out
    raise AssertionError("engine did not finish")


# ----------------------------------------------------------------------------- greedy == HF


ENGINE_VARIANTS = {
    "radix-page1": dict(enable_prefix_cache=True, page_size=1),
    "noradix-page1": dict(enable_prefix_cache=False, page_size=1),
    "radix-page4": dict(enable_prefix_cache=True, page_size=4),
    "noradix-page4": dict(enable_prefix_cache=False, page_size=4),
    "radix-page4-chunked5": dict(enable_prefix_cache=True, page_size=4, max_prefill_tokens=5),
    # Decode steps at static shapes (rollout.decode_graphs: CUDA graphs on a GPU, eager here).
    "radix-page4-static-decode": dict(enable_prefix_cache=True, page_size=4, decode_graphs=True),
}


@pytest.mark.parametrize("variant", list(ENGINE_VARIANTS))
@pytest.mark.parametrize("family", FAMILY_LIST)
def test_greedy_equals_hf(tiny_hf_checkpoints, family, variant):
    model, directory = tiny_hf_checkpoints(family)
    max_new = 16
    prompts = greedy_prompts(model, family, max_new)
    refs = [hf_greedy(model, p, max_new)[0] for p in prompts]
    engine = make_engine(directory, **ENGINE_VARIANTS[variant])
    params = SamplingParams(n=2, max_new_tokens=max_new, **GREEDY)

    # Twice on one engine: the second call reuses whatever the first left in the prefix cache.
    for call in range(2):
        outs = engine.generate(prompts, params)
        assert len(outs) == len(prompts)
        for i, (per_prompt, ref) in enumerate(zip(outs, refs)):
            assert len(per_prompt) == 2
            for j, s in enumerate(per_prompt):
                assert list(s.token_ids) == ref, (
                    f"call {call}, prompt {i} (len {len(prompts[i])}), sample {j}"
                )
                assert s.finish_reason == "length"
                assert len(s.logprobs) == max_new

    stats = engine.stats()
    if ENGINE_VARIANTS[variant]["enable_prefix_cache"]:
        assert stats["prefix_cache_hit_tokens"] > 0, stats
    else:
        assert stats["prefix_cache_hit_tokens"] == 0, stats
    assert stats["generated_tokens"] == 2 * 2 * len(prompts) * max_new, stats


@pytest.mark.parametrize(
    "family,page_size", [("qwen2", 1), ("qwen3", 1), ("llama", 1), ("qwen2", 4)]
)
def test_greedy_equals_hf_under_preemption(tiny_hf_checkpoints, family, page_size):
    model, directory = tiny_hf_checkpoints(family)
    max_new = 24
    prompts = greedy_prompts(model, family, max_new)
    refs = [hf_greedy(model, p, max_new)[0] for p in prompts]
    # Largest request: 30 prompt + 24 new = 54 tokens; all together need ~8x that.
    engine = make_engine(directory, kv_cache_tokens=64, page_size=page_size)
    outs = engine.generate(prompts, SamplingParams(n=1, max_new_tokens=max_new, **GREEDY))
    assert engine.stats()["preemptions"] > 0, engine.stats()
    for i, (per_prompt, ref) in enumerate(zip(outs, refs)):
        assert list(per_prompt[0].token_ids) == ref, f"prompt {i} (len {len(prompts[i])})"
        assert per_prompt[0].finish_reason == "length"


def test_seeded_sampling_unchanged_by_preemption(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen2")
    rng = random.Random(7)
    prompts = [[rng.randrange(97) for _ in range(n)] for n in (5, 17, 28, 11, 23, 8)]
    params = SamplingParams(
        n=2, temperature=1.0, top_k=30, top_p=0.95, max_new_tokens=24, seed=99, ignore_eos=True
    )
    big = make_engine(directory, kv_cache_tokens=4096).generate(prompts, params)
    small_engine = make_engine(directory, kv_cache_tokens=96)  # one request: 28 + 2 x 24 tokens
    small = small_engine.generate(prompts, params)
    assert small_engine.stats()["preemptions"] > 0, small_engine.stats()
    assert tokens(small) == tokens(big)


# ----------------------------------------------------------------------------- logprobs == HF


LOGPROB_CASES = {
    "T1.0-topp0.9-topk20": dict(temperature=1.0, top_p=0.9, top_k=20),
    "T0.7-topp0.8-topk10": dict(temperature=0.7, top_p=0.8, top_k=10),
    "greedy": dict(temperature=0.0),
}


@pytest.mark.parametrize("case", list(LOGPROB_CASES))
@pytest.mark.parametrize("family", FAMILY_LIST)
def test_logprobs_equal_hf(tiny_hf_checkpoints, family, case):
    model, directory = tiny_hf_checkpoints(family)
    rng = random.Random(11)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (5, 13, 22)]
    sp = LOGPROB_CASES[case]
    params = SamplingParams(n=3, max_new_tokens=16, ignore_eos=True, seed=5, **sp)
    outs = make_engine(directory).generate(prompts, params)
    t = sp["temperature"]
    worst = 0.0
    for prompt, per_prompt in zip(prompts, outs):
        assert len(per_prompt) == 3
        for s in per_prompt:
            toks = list(s.token_ids)
            assert len(toks) == 16 and len(s.logprobs) == 16
            ref = hf_logprobs(model, prompt, toks, t)
            got = torch.tensor([float(x) for x in s.logprobs], dtype=torch.float64)
            worst = max(worst, float((got - ref).abs().max()))
            if t > 0:
                # Every sampled token lies inside the truncated support. Checked with the
                # loosest reading of top_k + top_p (top-p over the untruncated distribution),
                # which contains the sequential HF reading; the chi-square test pins the rest.
                seq = torch.tensor([prompt + toks])
                with torch.inference_mode():
                    logits = model(seq).logits[0, len(prompt) - 1 : len(prompt) + 15].double() / t
                for pos, tok in enumerate(toks):
                    probs = torch.softmax(logits[pos], -1)
                    order = probs.argsort(descending=True)
                    rank = int((order == tok).nonzero())
                    before = float(probs[order[:rank]].sum())
                    assert rank < sp["top_k"], f"token {tok} has rank {rank} >= top_k {sp['top_k']}"
                    assert before < sp["top_p"], f"token {tok} lies outside top_p {sp['top_p']}"
    assert worst <= LOGPROB_ATOL, f"max |engine logprob - HF log_softmax(logits/T)| = {worst:.3g}"


# ----------------------------------------------------------------------------- seeding


def test_seeded_request_same_alone_and_in_batch(tiny_hf_checkpoints):
    model, directory = tiny_hf_checkpoints("qwen3")
    vocab = model.config.vocab_size
    rng = random.Random(3)
    target_prompt = [rng.randrange(vocab) for _ in range(17)]
    target = SamplingParams(
        n=2, temperature=0.9, top_p=0.95, top_k=30, max_new_tokens=20, seed=1234, ignore_eos=True
    )

    alone = make_engine(directory).generate([target_prompt], target)[0]
    alone_tokens = [list(s.token_ids) for s in alone]
    assert alone_tokens[0] != alone_tokens[1], (
        "two samples of one request must differ (seeds s, s+1)"
    )

    # Sample j uses seed + j: sample 1 of seed 1234 is sample 0 of seed 1235.
    shifted = make_engine(directory).generate(
        [target_prompt], dataclasses.replace(target, n=1, seed=1235)
    )[0]
    assert list(shifted[0].token_ids) == alone_tokens[1]

    others, other_params = [], []
    for k in range(64):
        others.append([rng.randrange(vocab) for _ in range(rng.randint(3, 40))])
        kind = k % 4
        if kind == 0:
            other_params.append(
                SamplingParams(
                    n=rng.randint(1, 3),
                    temperature=1.0,
                    max_new_tokens=rng.randint(4, 24),
                    ignore_eos=True,
                )
            )
        elif kind == 1:
            other_params.append(
                SamplingParams(
                    n=1, temperature=0.0, max_new_tokens=rng.randint(4, 24), ignore_eos=True
                )
            )
        elif kind == 2:
            other_params.append(
                SamplingParams(
                    n=2,
                    temperature=0.6,
                    top_k=5,
                    seed=rng.randrange(10_000),
                    max_new_tokens=rng.randint(4, 24),
                    ignore_eos=True,
                )
            )
        else:
            # Shares the target's prompt prefix, so the target's KV pages are shared too.
            others[-1] = target_prompt[:10] + others[-1]
            other_params.append(
                SamplingParams(
                    n=1,
                    temperature=1.0,
                    top_p=0.5,
                    max_new_tokens=rng.randint(4, 24),
                    ignore_eos=True,
                )
            )
    for variant in (dict(), dict(page_size=4, max_running_requests=16, max_prefill_tokens=64)):
        prompts = others[:29] + [target_prompt] + others[29:]
        params = other_params[:29] + [target] + other_params[29:]
        outs = make_engine(directory, seed=42, **variant).generate(prompts, params)
        assert len(outs) == 65
        assert [list(s.token_ids) for s in outs[29]] == alone_tokens, variant
        for s_alone, s_batch in zip(alone, outs[29]):
            diff = max(abs(a - b) for a, b in zip(s_alone.logprobs, s_batch.logprobs))
            assert diff <= LOGPROB_ATOL, variant


# ----------------------------------------------------------------------------- prefix reuse


def test_prefill_computed_once_per_prompt(tiny_hf_checkpoints):
    _, directory = tiny_hf_checkpoints("qwen2")
    rng = random.Random(21)
    prompts = [[rng.randrange(97) for _ in range(rng.randint(16, 40))] for _ in range(32)]
    total = sum(map(len, prompts))
    n, max_new = 8, 4
    params = SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, ignore_eos=True)

    on = make_engine(directory, kv_cache_tokens=16384)
    outs = on.generate(prompts, params)
    assert all(len(p) == n for p in outs)
    s_on = on.stats()
    assert s_on["prefill_tokens_computed"] <= 1.1 * total, (
        f"prefix cache on: computed {s_on['prefill_tokens_computed']} prompt tokens for "
        f"{total} distinct ones (limit 1.1x); stats {s_on}"
    )
    assert s_on["generated_tokens"] == 32 * n * max_new
    assert s_on["preemptions"] == 0

    # Without the cache a request's samples still share one prefill of its prompt (its forks
    # hold the prompt's pages in a tree of their own) and sample exactly what they sample with it.
    off = make_engine(directory, kv_cache_tokens=16384, enable_prefix_cache=False)
    outs_off = off.generate(prompts, params)
    s_off = off.stats()
    ratio = s_off["prefill_tokens_computed"] / total
    assert 0.9 <= ratio <= 1.1, f"prefix cache off: {ratio:.2f}x the prompt tokens, expected ~1x"
    assert s_off["prefix_cache_hit_tokens"] == 0
    assert [[list(s.token_ids) for s in p] for p in outs_off] == [
        [list(s.token_ids) for s in p] for p in outs
    ]
    for p_on, p_off in zip(outs, outs_off):
        for s_on, s_off_ in zip(p_on, p_off):
            assert max(abs(a - b) for a, b in zip(s_on.logprobs, s_off_.logprobs)) <= LOGPROB_ATOL
    assert off.scheduler.allocator.pool.num_free_pages == off.scheduler.allocator.pool.num_pages


# ----------------------------------------------------------------------------- RL lifecycle


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_update_weights_equals_fresh_engine(tiny_hf_checkpoints, tmp_path, family):
    model_a, dir_a = tiny_hf_checkpoints(family)
    dir_b = save_hf_model(make_hf_model(family, seed=1), tmp_path / "b")
    prompts = greedy_prompts(model_a, family, 16)
    params = SamplingParams(n=2, max_new_tokens=16, **GREEDY)

    engine = make_engine(dir_a, page_size=4)
    before = tokens(engine.generate(prompts, params))
    engine.generate(prompts, params)  # the prefix cache now holds model A's KV for these prompts
    v0 = engine.weight_version
    engine.update_weights(load_file(str(dir_b / "model.safetensors")).items())
    assert engine.weight_version > v0

    after = tokens(engine.generate(prompts, params))
    fresh = tokens(make_engine(dir_b, page_size=4).generate(prompts, params))
    assert after == fresh
    assert after != before, "new weights must change the outputs"


def test_update_weights_rejects_bad_name_and_shape(tiny_hf_checkpoints):
    model, directory = tiny_hf_checkpoints("qwen2")
    engine = make_engine(directory)
    bad_name = "model.layers.0.self_attn.q_proj.weight_typo"
    with pytest.raises((ValueError, KeyError)) as err:
        engine.update_weights([(bad_name, torch.zeros(64, 64))])
    assert bad_name in str(err.value)
    name = "model.layers.1.mlp.up_proj.weight"
    with pytest.raises(ValueError) as err:
        engine.update_weights([(name, torch.zeros(3, 5))])
    assert name in str(err.value) and re.search(r"shape|size", str(err.value), re.I), str(err.value)


def test_release_and_resume_memory(tiny_hf_checkpoints):
    model, directory = tiny_hf_checkpoints("llama")
    prompts = greedy_prompts(model, "llama", 16)
    params = SamplingParams(n=2, max_new_tokens=16, **GREEDY)
    engine = make_engine(directory, page_size=4)
    before = tokens(engine.generate(prompts, params))
    assert before == [[hf_greedy(model, p, 16)[0]] * 2 for p in prompts]
    engine.release_memory()
    with pytest.raises(RuntimeError, match=r"(?i)releas|resume"):
        engine.generate(prompts, params)
    engine.resume_memory()
    assert tokens(engine.generate(prompts, params)) == before


# ----------------------------------------------------------------------------- finish reasons


def _stop_token(ref: list[int], lo: int = 3, hi: int = 10) -> tuple[int, int]:
    """A token whose first occurrence in `ref` is at index k in [lo, hi)."""
    for k in range(lo, hi):
        if ref[k] not in ref[:k]:
            return ref[k], k
    raise AssertionError(f"no fresh token in {ref[lo:hi]}")


def test_stop_token_ids_and_max_new_tokens(tiny_hf_checkpoints):
    model, directory = tiny_hf_checkpoints("qwen2")  # its config has no EOS
    prompt = greedy_prompts(model, "qwen2", 24)[4]
    ref = hf_greedy(model, prompt, 24)[0]
    tok, k = _stop_token(ref)
    engine = make_engine(directory)
    out = engine.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=[tok]),
            SamplingParams(temperature=0.0, max_new_tokens=5),
        ],
    )
    stopped, short = out[0][0], out[1][0]
    assert list(stopped.token_ids) == ref[: k + 1] and stopped.finish_reason == "stop"
    assert len(stopped.logprobs) == k + 1
    assert list(short.token_ids) == ref[:5] and short.finish_reason == "length"
    # No EOS in config: without stop ids the engine runs to max_new_tokens.
    full = engine.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=24))[0][0]
    assert list(full.token_ids) == ref and full.finish_reason == "length"


def test_eos_from_model_config(tiny_hf_checkpoints, tmp_path):
    model, _ = tiny_hf_checkpoints("qwen2")
    prompt = greedy_prompts(model, "qwen2", 24)[4]
    ref = hf_greedy(model, prompt, 24)[0]
    eos, k = _stop_token(ref, 3, 8)
    eos2, k2 = _stop_token(ref, k + 1, 20)

    # (a) EOS in config.json (and generation_config.json, as HF saves it); same weights.
    model_eos = make_hf_model("qwen2", eos_token_id=eos)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model_eos.state_dict().values(), model.state_dict().values())
    )
    dir_a = save_hf_model(model_eos, tmp_path / "a")
    assert json.loads((dir_a / "config.json").read_text())["eos_token_id"] == eos
    engine = make_engine(dir_a)
    out = engine.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0.0, max_new_tokens=24),
            SamplingParams(temperature=0.0, max_new_tokens=24, ignore_eos=True),
        ],
    )
    assert list(out[0][0].token_ids) == ref[: k + 1] and out[0][0].finish_reason == "stop"
    assert list(out[1][0].token_ids) == ref and out[1][0].finish_reason == "length"

    # (b) EOS only in generation_config.json, as a list: the first one met stops.
    dir_b = tmp_path / "b"
    shutil.copytree(dir_a, dir_b)
    cfg = json.loads((dir_b / "config.json").read_text())
    cfg.pop("eos_token_id", None)
    (dir_b / "config.json").write_text(json.dumps(cfg))
    gen = json.loads((dir_b / "generation_config.json").read_text())
    gen["eos_token_id"] = [eos2, 10_000]
    (dir_b / "generation_config.json").write_text(json.dumps(gen))
    out = make_engine(dir_b).generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=24))
    assert list(out[0][0].token_ids) == ref[: k2 + 1] and out[0][0].finish_reason == "stop"


def test_abort_running_request(tiny_hf_checkpoints):
    model, directory = tiny_hf_checkpoints("qwen2")
    prompts = greedy_prompts(model, "qwen2", 24)
    long_ref = hf_greedy(model, prompts[3], 24)[0]
    engine = make_engine(directory)
    rid_long = engine.add_request(
        prompts[3], SamplingParams(n=2, temperature=0.0, max_new_tokens=400, ignore_eos=True)
    )
    rid_other = engine.add_request(prompts[1], SamplingParams(temperature=0.0, max_new_tokens=24))
    assert rid_long != rid_other
    done = {}
    for _ in range(6):
        for out in engine.step():
            done[out.request_id] = out
    assert rid_long not in done
    ret = engine.abort(rid_long)
    if ret is not None and hasattr(ret, "samples"):
        done[ret.request_id] = ret
    done.update(run_until_done(engine))

    aborted = done[rid_long]
    assert list(aborted.prompt_token_ids) == prompts[3]
    assert len(aborted.samples) == 2
    for s in aborted.samples:
        assert s.finish_reason == "abort"
        assert len(s.token_ids) < 400 and list(s.token_ids) == long_ref[: len(s.token_ids)]
    other = done[rid_other].samples[0]
    assert (
        list(other.token_ids) == hf_greedy(model, prompts[1], 24)[0]
        and other.finish_reason == "length"
    )
    assert not engine.has_unfinished()


# ----------------------------------------------------------------------------- distribution


SAMPLER_CASES = {
    # top_k binds, top_p barely trims
    "topk6-topp0.95": dict(top_k=6, top_p=0.95),
    # top_p binds, top_k keeps most of the mass
    "topk40-topp0.5": dict(top_k=40, top_p=0.5),
    # both bind: HF order (temperature, then top_k, then top_p over the renormalised top-k)
    "topk15-topp0.7": dict(top_k=15, top_p=0.7),
    # min_p alone (optional in the issue; the engine supports it)
    "minp0.3": dict(top_k=-1, top_p=1.0, min_p=0.3),
}


def _truncated_target(
    logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0, sequential: bool = True
) -> torch.Tensor:
    if sequential:  # HF's own warpers in generate's order, the reference
        procs = transformers.LogitsProcessorList()
        if top_k > 0:
            procs.append(transformers.TopKLogitsWarper(top_k))
        if top_p < 1.0:
            procs.append(transformers.TopPLogitsWarper(top_p))
        if min_p > 0.0:
            procs.append(transformers.MinPLogitsWarper(min_p))
        scores = procs(torch.zeros(1, 1, dtype=torch.long), logits[None].clone())[0]
        return torch.softmax(scores, -1)
    # joint reading (top_p over the untruncated distribution), only for the failure message
    probs = torch.softmax(logits, -1)
    sorted_p, order = probs.sort(descending=True)
    keep = ((sorted_p.cumsum(0) - sorted_p) < top_p) & (sorted_p >= min_p * sorted_p[0])
    if top_k > 0:
        keep[top_k:] = False
    out = torch.zeros_like(probs)
    out[order[keep]] = sorted_p[keep]
    return out / out.sum()


def _chi2(counts: torch.Tensor, target: torch.Tensor) -> float:
    from scipy.stats import chisquare

    support = target > 0
    n = float(counts.sum())
    exp = (target[support] * n).numpy()
    obs = counts[support].double().numpy()
    return float(chisquare(obs, exp).pvalue) if int(counts[~support].sum()) == 0 else 0.0


@pytest.mark.parametrize("case", list(SAMPLER_CASES))
def test_sampling_distribution_matches_hf(tiny_hf_checkpoints, case):
    model, directory = tiny_hf_checkpoints("qwen2")
    rng = random.Random(5)
    prompt = [rng.randrange(97) for _ in range(12)]
    logits = hf_next_logits(model, prompt)
    sp = SAMPLER_CASES[case]
    target = _truncated_target(logits, **sp)
    support = target > 0
    assert 2 <= int(support.sum()) < 20, "the case must truncate, to a few tokens"

    # 4000 draws: 16 copies of the prompt x n=250 (n may not exceed max_running_requests),
    # one seeded request each, seeds spaced so that no two samples share a generator seed.
    n, copies = 4000, 16
    outs = make_engine(directory, kv_cache_tokens=8192).generate(
        [prompt] * copies,
        [
            SamplingParams(
                n=n // copies,
                temperature=1.0,
                max_new_tokens=1,
                ignore_eos=True,
                seed=777 + 1000 * i,
                **sp,
            )
            for i in range(copies)
        ],
    )
    samples = [s for per_prompt in outs for s in per_prompt]
    drawn = [s.token_ids[0] for s in samples]
    assert len(drawn) == n
    counts = torch.bincount(torch.tensor(drawn), minlength=logits.numel())
    outside = int(counts[~support].sum())
    p = _chi2(counts, target)
    p_joint = _chi2(counts, _truncated_target(logits, **sp, sequential=False))
    assert outside == 0 and p > CHI2_P_MIN, (
        f"{n} engine samples vs HF truncated target: {outside} outside the support, chi-square "
        f"p = {p:.3g} (must be > {CHI2_P_MIN}); p under the joint top-k/top-p reading = "
        f"{p_joint:.3g}"
    )
    # The logprob of the drawn token is the untruncated one.
    full = torch.log_softmax(logits, -1)
    worst = max(abs(float(s.logprobs[0]) - float(full[s.token_ids[0]])) for s in samples[:200])
    assert worst <= LOGPROB_ATOL
