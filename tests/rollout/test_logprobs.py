"""Opt-in log-probs (`SamplingParams.top_logprobs`, `prompt_logprobs`) against an exact float64
HF forward on the same weights.

* top_logprobs=k: per sampled token, the k most likely tokens of log_softmax(logits / T) over the
  full vocabulary (T = 1 when greedy), before truncation: the ids and values of HF's top-k at
  that position, within 1e-10; the sampled token's own log-prob unchanged (equal to the value
  without the option);
* prompt_logprobs: per prompt token, HF's log_softmax(logits)[token] at the position before it
  (None for the first), whatever the chunking of the prefill or a cached prefix of the prompt;
* both through speculative verification (tokens emitted several per step) and forks (n > 1);
* without the options the outputs carry None.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from exact_float64 import exact_float64

from rollout import Engine, EngineConfig, SamplingParams
from rollout.speculative.verify import sampling_distribution

from tiny_hf import make_hf_model, save_hf_model

ATOL = 1e-10  # float64 engine vs exact-float64 HF
PROMPTS = [[5, 9, 2, 7, 11, 3, 8, 5, 9, 2, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 3]]


@pytest.fixture(scope="module")
def model64(tmp_path_factory):
    hf = make_hf_model("qwen2", seed=0, dtype=torch.float64)
    directory = save_hf_model(hf, tmp_path_factory.mktemp("logprobs64"))
    return exact_float64(hf), directory


def _engine(directory, **kw) -> Engine:
    return Engine(EngineConfig(model_path=str(directory), dtype="float64", page_size=2, **kw))


def _run(engine: Engine, prompts, params):
    ids = [engine.add_request(p, params) for p in prompts]
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            outs[out.request_id] = out
        engine.check_integrity()
    return [outs[i] for i in ids]


def _hf_logprobs(hf, ids: list[int], temperature: float) -> torch.Tensor:
    """[len(ids), V]: log_softmax(logits / T) at every position (row i predicts ids[i + 1])."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0].double()
    # divided by the request's T itself, as the trainer does (never a float32 rounding of it)
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def _check_top(hf, prompt, sample, k, temperature):
    ref = _hf_logprobs(hf, prompt + sample.token_ids, temperature)
    assert len(sample.top_logprobs) == len(sample.token_ids)
    for i, (token, lp, top) in enumerate(
        zip(sample.token_ids, sample.logprobs, sample.top_logprobs)
    ):
        row = ref[len(prompt) - 1 + i]
        values, order = row.topk(k)
        assert [t for t, _ in top] == order.tolist()
        got = torch.tensor([v for _, v in top], dtype=torch.float64)
        assert torch.allclose(got, values, atol=ATOL, rtol=0)
        assert abs(lp - float(row[token])) < ATOL


@pytest.mark.parametrize(
    "sampling",
    [dict(temperature=0.7, top_p=0.8, top_k=10), dict(temperature=0.0), dict(temperature=1.0)],
    ids=["truncated", "greedy", "plain"],
)
def test_top_logprobs_are_hf_top_k_and_leave_the_sample_unchanged(model64, sampling):
    hf, directory = model64
    base = SamplingParams(n=2, max_new_tokens=10, ignore_eos=True, seed=3, **sampling)
    asked = _run(_engine(directory), PROMPTS, dataclasses.replace(base, top_logprobs=5))
    plain = _run(_engine(directory), PROMPTS, base)
    for prompt, out, ref in zip(PROMPTS, asked, plain):
        assert out.prompt_logprobs is None
        for s, r in zip(out.samples, ref.samples):
            assert r.top_logprobs is None
            assert s.token_ids == r.token_ids and s.logprobs == r.logprobs
            _check_top(hf, prompt, s, 5, sampling["temperature"])


TIGHT_ATOL = 1e-12  # float64 engine vs exact-float64 HF on the sampled tokens: rounding only


@pytest.mark.parametrize("temperature", [0.7, 0.8, 1.3])
def test_sampled_logprobs_divide_by_the_exact_temperature(model64, temperature):
    """At T != 1 every float64 log-prob is log_softmax(logits / T) with T the request's own
    float64 number: a float32 rounding of T (a relative error ~1e-8) is far above the bound.
    The RL case (no truncation), with top-k alternatives, and speculative verification's
    distribution."""
    hf, directory = model64
    params = SamplingParams(
        n=2, max_new_tokens=8, ignore_eos=True, seed=5, temperature=temperature, top_logprobs=3
    )
    for prompt, out in zip(PROMPTS, _run(_engine(directory), PROMPTS, params)):
        for sample in out.samples:
            ref = _hf_logprobs(hf, prompt + sample.token_ids, temperature)
            for i, (token, lp, top) in enumerate(
                zip(sample.token_ids, sample.logprobs, sample.top_logprobs)
            ):
                row = ref[len(prompt) - 1 + i]
                assert abs(lp - float(row[token])) <= TIGHT_ATOL, (i, lp, float(row[token]))
                assert max(abs(v - float(row[t])) for t, v in top) <= TIGHT_ATOL
    # speculative verification's distribution (the log-probs of accepted drafts), on the side
    logits = torch.randn(3, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    logprobs_all, _ = sampling_distribution(logits, [params] * 3)
    assert torch.allclose(
        logprobs_all, torch.log_softmax(logits / temperature, -1), atol=TIGHT_ATOL, rtol=0
    )


def test_prompt_logprobs_chunked_and_cached_prefix(model64):
    hf, directory = model64
    engine = _engine(directory, max_prefill_tokens=4)  # prompts prefill in chunks of 4
    params = SamplingParams(max_new_tokens=3, ignore_eos=True, seed=1, prompt_logprobs=True)
    first = _run(engine, PROMPTS, params)
    # the same prompts again: their prefixes are cached, still every position is scored
    again = _run(engine, PROMPTS, dataclasses.replace(params, top_logprobs=3))
    for prompt, a, b in zip(PROMPTS, first, again):
        ref = _hf_logprobs(hf, prompt, 1.0)
        want = [float(ref[i - 1, prompt[i]]) for i in range(1, len(prompt))]
        for out in (a, b):
            assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
            got = torch.tensor(out.prompt_logprobs[1:], dtype=torch.float64)
            assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=ATOL, rtol=0)
        assert a.prompt_top_logprobs is None
        assert b.prompt_top_logprobs[0] is None
        for i, top in enumerate(b.prompt_top_logprobs[1:], start=1):
            values, order = ref[i - 1].topk(3)
            assert [t for t, _ in top] == order.tolist()
            assert max(abs(v - float(w)) for (_, v), w in zip(top, values)) < ATOL
        # the samples drawn after a prompt-logprob prefill equal an ordinary request's
        (plain,) = _run(
            _engine(directory), [prompt], dataclasses.replace(params, prompt_logprobs=False)
        )
        assert a.samples[0].token_ids == plain.samples[0].token_ids


def test_top_logprobs_through_speculative_verification(model64):
    hf, directory = model64
    # a repetitive prompt: the n-gram lookup drafts, and verification emits several tokens a step
    prompt = [4, 5, 6, 7] * 6
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True, top_logprobs=4)
    engine = _engine(directory, speculative_method="ngram", num_speculative_tokens=3)
    (out,) = _run(engine, [prompt], params)
    assert engine.stats()["spec_accepted_tokens"] > 0
    _check_top(hf, prompt, out.samples[0], 4, 0.0)
