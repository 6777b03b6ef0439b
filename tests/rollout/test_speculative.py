"""Speculative decoding is exact.

* T = 1 (and T = 0.8 with top-k): the joint distribution of the first three generated tokens
  with speculation matches the target model's, computed exactly with HF transformers from the
  same weights, by a chi-square test over >= 20k samples (reject at p < 0.01), per proposer;
  the drafts are really exercised (accepted and rejected drafts both counted).
* T = 0: output equals the output without speculation token for token, and logprobs agree.
* The suffix index proposes what followed the latest occurrence of the longest matching n-gram.
"""

import dataclasses
import itertools

import pytest
import torch
from scipy.stats import chisquare
from tiny_hf import make_hf_model, save_hf_model

from rollout import Engine, EngineConfig, SamplingParams
from rollout.speculative import SuffixIndex

VOCAB = 6
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
P_MIN = 0.01


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    model = make_hf_model("qwen2", seed=3, vocab_size=VOCAB)
    return model, save_hf_model(model, tmp_path_factory.mktemp("spec"))


@torch.inference_mode()
def target_joint(model, temperature: float, top_k: int) -> dict[tuple[int, ...], float]:
    """Exact p(x1, x2, x3 | PROMPT) under temperature and top-k, from HF logits."""
    def next_probs(prefix):
        logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double() / temperature
        if top_k > 0:
            kth = logits.topk(top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.softmax(logits, -1)

    joint = {}
    p1 = next_probs(())
    for a in range(VOCAB):
        p2 = next_probs((a,))
        for b in range(VOCAB):
            p3 = next_probs((a, b))
            for c in range(VOCAB):
                joint[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    return joint


def chi_square_p(counts: dict, joint: dict, total: int) -> float:
    observed, expected, small_obs, small_exp = [], [], 0, 0.0
    for key, p in joint.items():
        if p == 0.0:   # truncated away: must never be drawn
            assert counts.get(key, 0) == 0, f"{key} has probability 0 but was sampled"
            continue
        if total * p < 5:   # pool rare outcomes so every bin expects >= 5
            small_obs += counts.get(key, 0)
            small_exp += total * p
        else:
            observed.append(counts.get(key, 0))
            expected.append(total * p)
    if small_exp > 0:
        observed.append(small_obs)
        expected.append(small_exp)
    scale = sum(observed) / sum(expected)   # exact up to float rounding
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize("method, temperature, top_k", [("ngram", 1.0, -1), ("group", 1.0, -1), ("group", 0.8, 4)])
def test_speculative_sampling_matches_target_distribution(tiny_vocab_model, method, temperature, top_k):
    model, directory = tiny_vocab_model
    engine = Engine(EngineConfig(model_path=str(directory), speculative_method=method, num_speculative_tokens=2,
                                 max_running_requests=512, kv_cache_tokens=512 * 16 * 2, seed=11))
    requests, n = 40, 512
    outs = engine.generate([PROMPT] * requests, SamplingParams(n=n, temperature=temperature, top_k=top_k,
                                                                max_new_tokens=3, ignore_eos=True))
    counts: dict[tuple[int, ...], int] = {}
    for per_prompt in outs:
        for sample in per_prompt:
            key = tuple(sample.token_ids)
            counts[key] = counts.get(key, 0) + 1
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 5000, stats                     # speculation really ran ...
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats   # ... and rejected some
    p = chi_square_p(counts, target_joint(model, temperature, top_k), requests * n)
    assert p > P_MIN, f"chi-square p={p:.4g} <= {P_MIN}: speculative samples do not follow the target"


@pytest.mark.parametrize("method", ["ngram", "group"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_unchanged_by_speculation(tiny_hf_checkpoints, method, page_size):
    _, directory = tiny_hf_checkpoints("qwen3")
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 101, (5,), generator=g).tolist()
    prompts = [motif * 3 + torch.randint(0, 101, (k,), generator=g).tolist() for k in (1, 4, 9)]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=48, ignore_eos=True)
    plain = Engine(EngineConfig(model_path=str(directory), page_size=page_size)).generate(prompts, params)
    engine = Engine(EngineConfig(model_path=str(directory), page_size=page_size, speculative_method=method))
    spec = engine.generate(prompts, params)
    engine.check_integrity()
    assert engine.stats()["spec_accepted_tokens"] > 0
    for a, b in zip(itertools.chain(*plain), itertools.chain(*spec)):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_stop_token_inside_an_accepted_draft(tiny_hf_checkpoints):
    """A stop token that arrives inside an accepted draft truncates there, exactly as without
    speculation, and leaves the cache consistent. With the `group` proposer a second greedy
    rollout of a prompt drafts from the first one's completion, so whole drafts are accepted and
    each step emits several tokens: a stop on their first occurrences lands inside drafts."""
    _, directory = tiny_hf_checkpoints("qwen3")
    prompts = [[5, 17, 42, 8, 99, 3], [61, 2, 2, 7]]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=30, ignore_eos=True)
    plain_engine = Engine(EngineConfig(model_path=str(directory), page_size=1))
    plain = plain_engine.generate(prompts, greedy)
    firsts = {}   # token -> first position in prompt 0's completion
    for i, t in enumerate(plain[0][0].token_ids):
        firsts.setdefault(t, i)
    for stop in [t for t, i in firsts.items() if 2 <= i < 25]:
        params = dataclasses.replace(greedy, stop_token_ids=[stop])
        expected = plain_engine.generate(prompts, params)
        engine = Engine(EngineConfig(model_path=str(directory), page_size=1, speculative_method="group"))
        engine.generate(prompts, greedy)                      # earlier completions to draft from
        got = engine.generate(prompts, params)
        engine.check_integrity()
        assert [s.token_ids for per in got for s in per] == [s.token_ids for per in expected for s in per], stop
        assert got[0][0].finish_reason == "stop"
        assert engine.stats()["spec_accepted_tokens"] > 0


def test_suffix_index_prefers_longest_latest_match():
    index = SuffixIndex(min_n=1, max_n=3)
    a = [5, 6, 7, 8, 5, 6, 9]
    index.update(0, a)
    assert index.propose([1, 5, 6], 3) == [9]            # latest "5 6" continued with 9 (and then nothing yet)
    assert index.propose([4, 6, 7], 2) == [8, 5]         # "6 7" -> 8 5
    b = [0, 7, 8, 1]
    index.update(1, b)
    assert index.propose([6, 7, 8], 2) == [5, 6]         # the longest match, "6 7 8", beats the newer "7 8"
    assert index.propose([2, 7, 8], 2) == [1]            # for "7 8" the newest occurrence wins
    assert index.propose([3], 2) == []
