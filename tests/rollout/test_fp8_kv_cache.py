"""The FP8 KV cache (`kv_cache_dtype="fp8_e4m3"`).

* quantize -> dequantize equals the formula written out (saturate(x / s) rounded by torch's
  float8_e4m3fn cast, times s) on random and adversarial values (zeros, outliers past the range,
  subnormals), and the scales are the smallest powers of two covering margin * amax;
* every attention path (the cascade dispatcher, i.e. the C kernel on CPU in float32, the flash
  and matmul paths, both ways of attending after a cached prefix) over an FP8 cache equals the
  same path over a float cache holding the dequantized values, bitwise (the dequantized values
  are exact, so the inputs are the same numbers), and differs from the unquantized result;
* an FP8 engine's log-probs equal Hugging Face transformers' forward whose post-RoPE K and V
  are quantized -> dequantized with the engine's scales (an attention function registered in
  HF), with the radix cache, suffix lanes, preemption-free parking and speculative decoding on;
* the scales equal a fresh calibration computed independently through HF from the same
  weights, bitwise, at start, after weight updates and after release / resume, and are never
  NaN or 1.0 by default.
"""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from test_attention import KERNELS, cascade_case, prefix_chunk_case, run_kernel

from rollout import Engine, EngineConfig, SamplingParams
from rollout.attention import _gather, attend_after_prefix, cascade_decode_attention
from rollout.kv_calibration import calibration_ids
from rollout.kv_quant import (
    CALIBRATION_MARGIN,
    FP8_MAX,
    count_clipped,
    dequantize,
    head_scale,
    quantize,
    scales_from_amax,
)

from tiny_hf import make_hf_model, save_hf_model


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ----------------------------------------------------------------------- quantize / scales


def test_scales_are_the_smallest_covering_powers_of_two():
    amax = torch.tensor([1.0, 3.0, 448.0, 1e-3, 0.0, 224.0 / CALIBRATION_MARGIN * 2**-5])
    scales = scales_from_amax(amax)
    for a, s in zip(amax.tolist(), scales.tolist()):
        assert s > 0 and math.isfinite(s)
        assert 2.0 ** round(math.log2(s)) == s  # a power of two
        if a > 0:
            assert CALIBRATION_MARGIN * a / s <= FP8_MAX  # covers the margin ...
            assert CALIBRATION_MARGIN * a / (s / 2) > FP8_MAX  # ... and is the smallest that does


def test_quantize_dequantize_equals_the_formula_on_adversarial_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 16, generator=g) * torch.tensor([0.01, 1.0, 100.0]).view(1, 3, 1)
    x[0, 0] = 0.0  # zeros
    x[1, 1, :4] = torch.tensor([1e6, -1e6, 449.0 * 0.5, -3e3])  # outliers past the range
    x[2, 2, :3] = torch.tensor([1e-30, 2.0**-15, -(2.0**-16)])  # subnormal / underflow
    scale = torch.tensor([2.0**-8, 0.5, 1.0])
    s = head_scale(scale, -2, 3)
    x8 = quantize(x, s)
    assert x8.dtype == torch.float8_e4m3fn
    # the formula, written out: clamp into the range, round with torch's e4m3 cast, rescale
    expected = torch.clamp(x.double() / s.double(), -448.0, 448.0).float()
    expected = expected.to(torch.float8_e4m3fn).double() * s.double()
    assert torch.equal(dequantize(x8, s, torch.float64), expected)
    # exact in every dtype the engine computes in (a power-of-two scale times an e4m3 value)
    for dtype in (torch.bfloat16, torch.float32):
        assert torch.equal(dequantize(x8, s, dtype).double(), expected)
    # re-storing a dequantized value gives back the same bytes
    assert torch.equal(
        quantize(dequantize(x8, s, torch.bfloat16), s).view(torch.uint8), x8.view(torch.uint8)
    )
    clipped = (x.abs() > 448.0 * s).sum()
    assert int(count_clipped(x, s)) == int(clipped) >= 3


# ----------------------------------------------------------------------- attention paths


def _quantized(cache: torch.Tensor, seed: int):
    """An FP8 copy of a head-major cache with per-head power-of-two scales, and the float cache
    of its dequantized values."""
    g = torch.Generator().manual_seed(seed)
    amax = cache.abs().amax(dim=(1, 2)) * (0.5 + torch.rand(cache.shape[0], generator=g))
    scale = scales_from_amax(amax)
    c8 = quantize(cache, head_scale(scale, 0, 3))
    return c8, scale, dequantize(c8, head_scale(scale, 0, 3), cache.dtype)


@pytest.mark.parametrize("path", ["dispatcher", "flash", "matmul"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cascade_decode_over_fp8_equals_attention_over_the_dequantized_cache(
    path, dtype, page_size
):
    q, k_cache, v_cache, meta, _ = cascade_case(page_size, dtype)
    k8, k_scale, k_deq = _quantized(k_cache, 1)
    v8, v_scale, v_deq = _quantized(v_cache, 2)
    scales = (k_scale, v_scale)
    if path == "dispatcher":  # on CPU in float32: the C kernel, reading the dequantized gather
        got = cascade_decode_attention(q, k8, v8, meta, page_size, kv_scales=scales)
        want = cascade_decode_attention(q, k_deq, v_deq, meta, page_size)
        plain = cascade_decode_attention(q, k_cache, v_cache, meta, page_size)
    else:
        gathered = [
            tuple(_gather(c, pages, page_size, s, dtype) for c, s in ((k8, k_scale), (v8, v_scale)))
            for pages in (meta.suffix_pages, meta.prefix_pages)
        ]
        got = KERNELS[path](q, meta, gathered[0], gathered[1])
        want = run_kernel(path, q, k_deq, v_deq, meta, page_size)
        plain = run_kernel(path, q, k_cache, v_cache, meta, page_size)
    assert torch.equal(got, want)
    assert not torch.equal(got, plain)  # the cache really was quantized


@pytest.mark.parametrize("per_head_kv", [True, False])
def test_attention_after_a_cached_prefix_reads_the_fp8_cache(per_head_kv):
    queries, k_cache, v_cache, slots = prefix_chunk_case(6, 2, seed=3)
    queries, k_cache, v_cache = (x.float() for x in (queries, k_cache, v_cache))
    k8, k_scale, k_deq = _quantized(k_cache, 4)
    v8, v_scale, v_deq = _quantized(v_cache, 5)
    got = attend_after_prefix(
        queries, k8, v8, slots, per_head_kv=per_head_kv, kv_scales=(k_scale, v_scale)
    )
    want = attend_after_prefix(queries, k_deq, v_deq, slots, per_head_kv=per_head_kv)
    assert torch.equal(got, want)


# ----------------------------------------------------------------------- engine vs HF


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made = {}

    def get(family):
        if family not in made:
            model = make_hf_model(family)
            made[family] = (model, save_hf_model(model, tmp_path_factory.mktemp(family)))
        return made[family]

    return get


def _hf_with_fp8_kv(model, scales):
    """`model` attending through an attention function that quantizes -> dequantizes its
    post-RoPE K and V with `scales` ((k, v) [L, Hkv]), or records their amax when `scales` is a
    dict to fill (calibration)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if isinstance(scales, dict):  # record: key/value [B, Hkv, T, D]
            scales.setdefault("k", {})[layer] = key.abs().amax(dim=(0, 2, 3))
            scales.setdefault("v", {})[layer] = value.abs().amax(dim=(0, 2, 3))
        else:
            k_s, v_s = (head_scale(s[layer], 1, 4) for s in scales)
            key = dequantize(quantize(key, k_s), k_s, key.dtype)
            value = dequantize(quantize(value, v_s), v_s, value.dtype)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register("fp8kv_test", attention)
    model.set_attn_implementation("fp8kv_test")
    return model


def hf_scales(model, num_tokens: int = 256):
    """The calibration computed through HF: amax over the calibration ids -> scales."""
    record: dict = {}
    _hf_with_fp8_kv(model, record)
    with torch.no_grad():
        model(calibration_ids(model.config.vocab_size, num_tokens)[None])
    model.set_attn_implementation("sdpa")
    layers = sorted(record["k"])
    return tuple(
        scales_from_amax(torch.stack([record[w][i] for i in layers]).float()) for w in "kv"
    )


def hf_logprobs(model, scales, sequence: list[int]) -> torch.Tensor:
    """log p(token t | tokens < t) for t >= 1, HF forward with FP8-round-tripped K/V."""
    _hf_with_fp8_kv(model, scales)
    with torch.no_grad():
        logits = model(torch.tensor([sequence])).logits[0].double()
    model.set_attn_implementation("sdpa")
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(sequence[1:])[:, None])[:, 0]


def fp8_engine(directory, **overrides) -> Engine:
    config = dict(
        model_path=str(directory),
        kv_cache_dtype="fp8_e4m3",
        page_size=4,
        kv_cache_tokens=512,
        max_model_len=128,
    )
    config.update(overrides)
    return Engine(EngineConfig(**config))


# No two prompts share a page-aligned prefix: see `test_prefix_reuse_across_requests`.
# Engine and HF compute K/V in float32 in different orders (batch shapes, fused projections, the
# small-batch linear kernel's dot products): equal to rounding, but where a value lies within
# that rounding of the midpoint between two e4m3 values the two round it to neighbours, one e4m3
# step (1/16 relative) apart. Rare, yet one such flip moves later log-probs by up to a few 1e-3
# (2.6e-3 seen: llama, n-gram speculation); the quantization itself moves them by ~1e-1, which
# the tests check stays more than 10x this bound.
LOGPROB_ATOL = 5e-3
PROMPTS = [[5, 9, 2, 7, 11, 3, 8, 1, 4], [6, 9, 2, 7, 11, 3, 8, 1, 6, 6], [1, 2, 3]]
ENGINE_VARIANTS = {
    "lanes": {},
    "gather": {"decode_suffix_lanes": False},
    "static-decode": {"decode_graphs": True},
    "ngram-speculation": {"speculative_method": "ngram", "num_speculative_tokens": 3},
    "chunked-prefill": {"max_prefill_tokens": 8, "enable_prefix_cache": False},
}


@pytest.mark.parametrize("variant", ENGINE_VARIANTS)
@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_fp8_engine_equals_hf_with_round_tripped_kv(checkpoints, family, variant):
    hf, directory = checkpoints(family)
    engine = fp8_engine(directory, **ENGINE_VARIANTS[variant])
    scales = (engine.pool.k_scale.clone(), engine.pool.v_scale.clone())
    assert torch.equal(scales[0], hf_scales(hf)[0]) and torch.equal(scales[1], hf_scales(hf)[1])
    params = SamplingParams(n=3, temperature=1.0, max_new_tokens=16, seed=7, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)
    engine.check_integrity()
    worst = _worst_logprob_error(engine, hf, scales, PROMPTS, outs)
    assert worst < LOGPROB_ATOL, worst
    # the same HF forward with unquantized K/V is far off: the check can fail
    seq = list(PROMPTS[0]) + list(outs[0][0].token_ids)
    with torch.no_grad():
        unquantized = torch.log_softmax(hf(torch.tensor([seq])).logits[0, :-1].double(), -1)
    unquantized = unquantized.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    assert (unquantized - hf_logprobs(hf, scales, seq)).abs().max() > 10 * LOGPROB_ATOL
    assert engine.stats()["kv_fp8_clipped_share"] < 0.01


def _worst_logprob_error(engine, hf, scales, prompts, outs) -> float:
    worst = 0.0
    for prompt, samples in zip(prompts, outs):
        for sample in samples:
            seq = list(prompt) + list(sample.token_ids)
            ref = hf_logprobs(hf, scales, seq)[len(prompt) - 1 :]
            got = torch.tensor(sample.logprobs, dtype=torch.float64)
            worst = max(worst, float((got - ref).abs().max()))
    return worst


def test_prefix_reuse_across_requests(checkpoints):
    """A request reusing another's cached prefix reads K/V the other request's batch computed:
    equal to its own up to float32 rounding, which FP8 rounding can amplify into one e4m3 step
    of an element (a value within rounding of a midpoint). So against HF recomputing the whole
    sequence the log-probs agree to that (well below the FP8 error itself), not to 1e-4."""
    hf, directory = checkpoints("qwen2")
    engine = fp8_engine(directory)
    scales = (engine.pool.k_scale.clone(), engine.pool.v_scale.clone())
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=3, ignore_eos=True)
    first = [[5, 9, 2, 7, 11, 3, 8, 1, 4]]
    engine.generate(first, params)
    reuse = [[5, 9, 2, 7, 11, 3, 8, 1, 6, 6]]
    hits_before = engine.stats()["prefix_cache_hit_tokens"]
    outs = engine.generate(reuse, params)
    assert engine.stats()["prefix_cache_hit_tokens"] > hits_before
    engine.check_integrity()
    assert _worst_logprob_error(engine, hf, scales, reuse, outs) < 5e-3


def _perturbed(hf, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        name: (p + 0.05 * torch.randn(p.shape, generator=g)).detach()
        for name, p in hf.state_dict().items()
    }


def test_scales_follow_weight_updates_and_release_resume(checkpoints):
    hf, directory = checkpoints("qwen2")
    engine = fp8_engine(directory)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=6, ignore_eos=True)
    for step in range(3):
        new = _perturbed(hf, step)
        if step == 1:  # colocated: everything released, weights pushed, then the KV pool
            engine.release_memory(weights=True)
            engine.resume_weights()
        elif step == 2:  # a KV-only release keeps the scales
            engine.release_memory()
        engine.update_weights(new.items())
        if not engine.pool.allocated:
            engine.alloc_kv()
        fresh = make_hf_model("qwen2")
        fresh.load_state_dict(new)
        want = hf_scales(fresh)
        assert torch.equal(engine.pool.k_scale, want[0]), step
        assert torch.equal(engine.pool.v_scale, want[1]), step
        assert torch.isfinite(engine.pool.k_scale).all()
        assert not (engine.pool.k_scale == 1.0).all()
        engine.generate(PROMPTS, params)
        engine.check_integrity()


def test_kept_kv_is_requantized_to_new_scales(checkpoints):
    """K/V kept across an update (parked, or running with keep_running) are re-stored under the
    new scales: their dequantized values are unchanged wherever they still fit the range."""
    hf, directory = checkpoints("qwen2")
    engine = fp8_engine(directory)
    engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True))
    pool = engine.pool
    before = [pool.dequantized(pool.k[layer], "k", layer) for layer in range(pool.num_layers)]
    old_scale = pool.k_scale.clone()
    new = dict(_perturbed(hf, 11))
    for name in new:  # K 4x larger (coarser scale), V 4x smaller (finer)
        if ".k_proj." in name:
            new[name] = new[name] * 4
        elif ".v_proj." in name:
            new[name] = new[name] / 4
    engine.update_weights(new.items())
    changed = not torch.equal(old_scale, pool.k_scale)
    assert changed  # the perturbation moved at least one scale
    for layer in range(pool.num_layers):
        after = pool.dequantized(pool.k[layer], "k", layer)
        ratio = (pool.k_scale[layer] / old_scale[layer]).view(-1, 1, 1)
        exact = (ratio <= 1) | (
            before[layer].abs() >= 2.0**-6 * old_scale[layer].view(-1, 1, 1) * ratio
        )
        fits = before[layer].abs() <= FP8_MAX * pool.k_scale[layer].view(-1, 1, 1)
        keep = exact & fits
        assert torch.equal(after[keep], before[layer][keep])


def test_parked_kv_is_adopted_across_an_idle_update(checkpoints):
    """A sample aborted with `park_kv` keeps its FP8 K/V across an idle update (same weights, so
    the same scales: the re-quantization is the identity); its continuation adopts it and
    equals HF over the whole sequence with round-tripped K/V."""
    hf, directory = checkpoints("qwen2")
    engine = fp8_engine(directory)
    prompt = PROMPTS[0]
    parked = SamplingParams(n=2, max_new_tokens=12, seed=5, ignore_eos=True, park_kv=True)
    rid = engine.add_request(prompt, parked)
    for _ in range(5):
        engine.step()
    engine.abort(rid)
    out = None
    while engine.has_unfinished() or out is None:
        for o in engine.step():
            if o.request_id == rid:
                out = o
    assert len(engine.scheduler.parked) == 2
    bytes_before = engine.pool.k.clone()
    engine.update_weights(hf.state_dict().items())
    assert torch.equal(engine.pool.k.view(torch.uint8), bytes_before.view(torch.uint8))
    scales = (engine.pool.k_scale.clone(), engine.pool.v_scale.clone())
    reused = engine.stats()["parked_reused_tokens"]
    more = SamplingParams(max_new_tokens=6, seed=9, ignore_eos=True, park_kv=True)
    conts = engine.generate([prompt + list(s.token_ids) for s in out.samples], more)
    assert engine.stats()["parked_reused_tokens"] > reused
    engine.check_integrity()
    worst = 0.0
    for s, cont in zip(out.samples, conts):
        seq = prompt + list(s.token_ids) + list(cont[0].token_ids)
        ref = hf_logprobs(hf, scales, seq)[len(prompt) + len(s.token_ids) - 1 :]
        got = torch.tensor(cont[0].logprobs, dtype=torch.float64)
        worst = max(worst, float((got - ref).abs().max()))
    assert worst < LOGPROB_ATOL, worst


def test_pool_slots_leave_dequantized_and_come_back_as_the_same_bytes():
    """`read_slots` / `write_slots`, the K/V a prefill handoff carries: from an FP8 pool in the
    model dtype (dequantized); into an FP8 pool with the same scales as the same bytes, into a
    float32 pool as the dequantized values."""
    from rollout.kv_pool import KVPool

    g = torch.Generator().manual_seed(0)

    def pool(storage):
        made = KVPool(
            num_layers=2,
            num_pages=8,
            page_size=4,
            num_kv_heads=3,
            head_dim=8,
            dtype=torch.float32,
            device=torch.device("cpu"),
            storage_dtype=storage,
        )
        if made.quantized:
            made.set_scales(torch.full((2, 3), 0.25), torch.full((2, 3), 2.0**-4))
        return made

    source, fp8, plain = pool(torch.float8_e4m3fn), pool(torch.float8_e4m3fn), pool(None)
    source.k.copy_(torch.randn(source.k.shape, generator=g).to(torch.float8_e4m3fn))
    source.v.copy_(torch.randn(source.v.shape, generator=g).to(torch.float8_e4m3fn))
    slots, dst = torch.tensor([3, 9, 10, 21]), torch.tensor([0, 5, 6, 30])
    k, v = source.read_slots(slots)
    assert k.dtype == torch.float32
    assert torch.equal(k, source.k[:, :, slots].float() * 0.25)
    assert torch.equal(v, source.v[:, :, slots].float() * 2.0**-4)
    fp8.write_slots(dst, k, v)
    plain.write_slots(dst, k, v)
    for x in ("k", "v"):
        got = getattr(fp8, x)[:, :, dst].view(torch.uint8)
        assert torch.equal(got, getattr(source, x)[:, :, slots].view(torch.uint8))
    assert torch.equal(plain.k[:, :, dst], k) and torch.equal(plain.v[:, :, dst], v)


def test_prefill_decode_handoff_between_fp8_engines(checkpoints):
    """A prefill engine with an FP8 pool hands its prompts' K/V over in the model dtype
    (dequantized); an FP8 decode engine with the same weights (so the same scales) stores the
    same bytes and continues like one FP8 engine doing both: same tokens, log-probs to the FP8
    rounding tolerance."""
    from rollout.prefill_decode import prefill

    _, directory = checkpoints("qwen2")
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=11)
    single = fp8_engine(directory)
    want = single.generate(PROMPTS, params)
    prefiller, decoder = fp8_engine(directory), fp8_engine(directory)
    handoffs = prefill(prefiller, PROMPTS, params)
    assert all(h.k.dtype == torch.float32 for h in handoffs)
    ids = [decoder.admit_prefilled(h, params) for h in handoffs]
    done = {}
    while decoder.has_unfinished():
        done.update((out.request_id, out) for out in decoder.step())
        decoder.check_integrity()
    for i, w in zip(ids, want):
        for got, ref in zip(done[i].samples, w):
            assert list(got.token_ids) == list(ref.token_ids)
            diff = max(abs(a - b) for a, b in zip(got.logprobs, ref.logprobs))
            assert diff < LOGPROB_ATOL
