"""Speculative decoding is exact.

* The joint distribution of the first three generated tokens with speculation matches the
  target model's, computed exactly from HF transformers' logits of the same weights with the
  sampling filter written out in the test (`truncated`), by a chi-square test over >= 20k
  samples (reject at p < P_MIN = 0.01), per proposer (n-gram, group-aware lookup, draft model):
  at T = 1; with top-k; with top-p; with min-p. The drafts are really exercised (accepted and
  rejected drafts both counted), and the filters really bite (outcomes they remove are never
  sampled). The draft model is another random model with the same vocabulary, so its q differs
  from the target's p and both branches of min(1, p/q) and the residual max(0, p - q) are taken.
* T = 0: output equals the output without speculation token for token, and logprobs agree.
* The suffix index proposes what followed the latest occurrence of the longest matching n-gram.
"""

import copy
import dataclasses
import itertools
import random

import pytest
import torch
from scipy.stats import chisquare

from rollout import Engine, EngineConfig, SamplingParams
from rollout.speculative import DraftBackoff, SuffixIndex

from tiny_hf import make_hf_model, save_hf_model

VOCAB = 6
PROMPT = [1, 2, 3, 1, 2, 3, 1, 2]
P_MIN = 0.01


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    model = make_hf_model("qwen2", seed=3, vocab_size=VOCAB)
    return model, save_hf_model(model, tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def tiny_vocab_draft(tmp_path_factory):
    """A different, smaller model over the same vocabulary: the draft model."""
    draft = make_hf_model("qwen2", seed=4, vocab_size=VOCAB, num_hidden_layers=1)
    return str(save_hf_model(draft, tmp_path_factory.mktemp("spec_draft")))


def spec_config(method: str, draft_dir: str | None, **kwargs) -> EngineConfig:
    if method == "draft":
        kwargs["speculative_draft_model_path"] = draft_dir
    return EngineConfig(speculative_method=method, **kwargs)


# A filter parameter this close to a token's cut-off would make the kept set depend on float
# rounding (the engine samples in float32): the reference refuses it.
MARGIN = 1e-4


def truncated(probs: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """`probs` with the sampling filters in Hugging Face's order, renormalised: top-k keeps the
    k most likely tokens; top-p then the smallest set of the most likely whose mass within the
    top-k distribution reaches top_p (a token is kept while the mass before it is < top_p);
    min-p then the tokens with prob >= min_p * the most likely's."""
    keep = torch.ones_like(probs, dtype=torch.bool)
    if top_k > 0:
        keep &= probs >= probs.topk(top_k).values[-1]
    if top_p < 1:
        within = probs * keep / (probs * keep).sum()
        ordered, order = within.sort(descending=True)
        before = ordered.cumsum(0) - ordered  # mass of the more likely tokens
        assert (before - top_p).abs().min() > MARGIN, f"top_p={top_p} is on a cut-off"
        keep[order[before >= top_p]] = False
    if min_p > 0:
        ratio = probs / probs.max()
        assert (ratio - min_p).abs().min() > MARGIN, f"min_p={min_p} is on a cut-off"
        keep &= ratio >= min_p
    kept = probs * keep
    return kept / kept.sum()


@torch.inference_mode()
def target_joint(
    model, temperature: float, top_k: int = -1, top_p: float = 1.0, min_p: float = 0.0
) -> dict[tuple[int, ...], float]:
    """Exact p(x1, x2, x3 | PROMPT) under temperature and the filters, from HF logits."""

    def next_probs(prefix):
        logits = model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].double()
        return truncated(torch.softmax(logits / temperature, -1), top_k, top_p, min_p)

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
        if p == 0.0:  # truncated away: must never be drawn
            assert counts.get(key, 0) == 0, f"{key} has probability 0 but was sampled"
            continue
        if total * p < 5:  # pool rare outcomes so every bin expects >= 5
            small_obs += counts.get(key, 0)
            small_exp += total * p
        else:
            observed.append(counts.get(key, 0))
            expected.append(total * p)
    if small_exp > 0:
        observed.append(small_obs)
        expected.append(small_exp)
    scale = sum(observed) / sum(expected)  # exact up to float rounding
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


@pytest.mark.parametrize(
    "method, temperature, top_k, top_p, min_p",
    [
        ("ngram", 1.0, -1, 1.0, 0.0),
        ("group", 1.0, -1, 1.0, 0.0),
        ("group", 0.8, 4, 1.0, 0.0),
        ("draft", 1.0, -1, 1.0, 0.0),
        ("draft", 0.8, 4, 1.0, 0.0),
        # top-p: each context keeps 1 to 4 of the 6 tokens
        ("ngram", 1.0, -1, 0.75, 0.0),
        ("group", 0.8, -1, 0.85, 0.0),
        ("draft", 1.0, -1, 0.75, 0.0),
        # min-p: each context keeps 1 to 5 of the 6 tokens
        ("ngram", 0.8, -1, 1.0, 0.5),
        ("group", 1.0, -1, 1.0, 0.4),
        ("draft", 0.8, -1, 1.0, 0.5),
    ],
)
def test_speculative_sampling_matches_target_distribution(
    tiny_vocab_model, tiny_vocab_draft, method, temperature, top_k, top_p, min_p
):
    model, directory = tiny_vocab_model
    # Back-off off: every step drafts, so the test sees the verify rule on every position.
    engine = Engine(
        spec_config(
            method,
            tiny_vocab_draft,
            model_path=str(directory),
            num_speculative_tokens=2,
            max_running_requests=512,
            kv_cache_tokens=512 * 16 * 2,
            seed=11,
            speculative_min_acceptance=0.0,
        )
    )
    requests, n = 40, 512
    outs = engine.generate(
        [PROMPT] * requests,
        SamplingParams(
            n=n,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            max_new_tokens=3,
            ignore_eos=True,
        ),
    )
    counts: dict[tuple[int, ...], int] = {}
    for per_prompt in outs:
        for sample in per_prompt:
            key = tuple(sample.token_ids)
            counts[key] = counts.get(key, 0) + 1
    stats = engine.stats()
    assert stats["spec_draft_tokens"] > 5000, stats  # speculation really ran ...
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], (
        stats
    )  # ... and rejected some
    joint = target_joint(model, temperature, top_k, top_p, min_p)
    if (top_k, top_p, min_p) != (-1, 1.0, 0.0):  # the filter removes outcomes
        assert sum(p == 0.0 for p in joint.values()) > VOCAB**3 // 3
    p = chi_square_p(counts, joint, requests * n)
    assert p > P_MIN, (
        f"chi-square p={p:.4g} <= {P_MIN}: speculative samples do not follow the target"
    )


def perturbed_draft(model, directory, scale: float, seed: int) -> str:
    """The target's weights plus Gaussian noise (`scale` x each tensor's std): a draft model that
    agrees with the target often but not always (both acceptance and rejection happen)."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    return str(save_hf_model(draft, directory))


@pytest.fixture(scope="module")
def qwen3_draft(tiny_hf_checkpoints, tmp_path_factory):
    model, _ = tiny_hf_checkpoints("qwen3")
    return perturbed_draft(model, tmp_path_factory.mktemp("qwen3_draft"), scale=0.05, seed=1)


@pytest.mark.parametrize("method", ["ngram", "group", "draft"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_greedy_unchanged_by_speculation(tiny_hf_checkpoints, qwen3_draft, method, page_size):
    _, directory = tiny_hf_checkpoints("qwen3")
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(0, 101, (5,), generator=g).tolist()
    prompts = [motif * 3 + torch.randint(0, 101, (k,), generator=g).tolist() for k in (1, 4, 9)]
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=48, ignore_eos=True)
    plain = Engine(EngineConfig(model_path=str(directory), page_size=page_size)).generate(
        prompts, params
    )
    engine = Engine(
        spec_config(method, qwen3_draft, model_path=str(directory), page_size=page_size)
    )
    spec = engine.generate(prompts, params)
    engine.check_integrity()
    stats = engine.stats()
    assert stats["spec_accepted_tokens"] > 0
    if method == "draft":  # the draft model disagrees with the target sometimes
        assert stats["spec_accepted_tokens"] < stats["spec_draft_tokens"]
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
    firsts = {}  # token -> first position in prompt 0's completion
    for i, t in enumerate(plain[0][0].token_ids):
        firsts.setdefault(t, i)
    for stop in [t for t, i in firsts.items() if 2 <= i < 25]:
        params = dataclasses.replace(greedy, stop_token_ids=[stop])
        expected = plain_engine.generate(prompts, params)
        engine = Engine(
            EngineConfig(model_path=str(directory), page_size=1, speculative_method="group")
        )
        engine.generate(prompts, greedy)  # earlier completions to draft from
        got = engine.generate(prompts, params)
        engine.check_integrity()
        assert [s.token_ids for per in got for s in per] == [
            s.token_ids for per in expected for s in per
        ], stop
        assert got[0][0].finish_reason == "stop"
        assert engine.stats()["spec_accepted_tokens"] > 0


def test_suffix_index_prefers_longest_latest_match():
    index = SuffixIndex(min_n=1, max_n=3)
    a = [5, 6, 7, 8, 5, 6, 9]
    index.update(0, a)
    assert index.propose([1, 5, 6], 3) == [
        9
    ]  # latest "5 6" continued with 9 (and then nothing yet)
    assert index.propose([4, 6, 7], 2) == [8, 5]  # "6 7" -> 8 5
    b = [0, 7, 8, 1]
    index.update(1, b)
    assert index.propose([6, 7, 8], 2) == [
        5,
        6,
    ]  # the longest match, "6 7 8", beats the newer "7 8"
    assert index.propose([2, 7, 8], 2) == [1]  # for "7 8" the newest occurrence wins
    assert index.propose([3], 2) == []


def test_draft_model_under_kv_pressure_with_aborts(tiny_hf_checkpoints, qwen3_draft):
    """A draft KV pool far too small for every sequence: draft K/V is evicted and recomputed all
    the time, target pages are preempted, requests are aborted; bookkeeping holds after every
    step (both pools), nothing leaks, and greedy outputs equal plain decoding."""
    _, directory = tiny_hf_checkpoints("qwen3")
    rng = random.Random(0)
    prompts = [[rng.randrange(101) for _ in range(rng.randint(2, 20))] for _ in range(16)]
    params = [
        SamplingParams(
            n=rng.choice([1, 2]),
            temperature=0.0,
            max_new_tokens=rng.randint(4, 30),
            ignore_eos=True,
        )
        for _ in prompts
    ]
    plain = Engine(EngineConfig(model_path=str(directory), page_size=2)).generate(prompts, params)
    engine = Engine(
        spec_config(
            "draft",
            qwen3_draft,
            model_path=str(directory),
            page_size=2,
            kv_cache_tokens=160,
            max_running_requests=8,
            speculative_draft_kv_tokens=64,
        )
    )
    ids = {engine.add_request(p, sp): i for i, (p, sp) in enumerate(zip(prompts, params))}
    aborted, outputs = set(), {}
    while engine.has_unfinished():
        if rng.random() < 0.03:
            victim = rng.choice([r for r in ids if r not in outputs])
            engine.abort(victim)
            aborted.add(victim)
        for out in engine.step():
            outputs[out.request_id] = out.samples
        engine.check_integrity()
    stats = engine.stats()
    assert engine.draft_model.evictions > 0 and stats["preemptions"] > 0, stats
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_draft_tokens"], stats
    assert (
        engine.draft_model.pool.num_free_pages == engine.draft_model.pool.num_pages
    )  # all forgotten
    for request_id, i in ids.items():
        for got, ref in zip(outputs[request_id], plain[i]):
            if request_id in aborted and got.finish_reason == "abort":
                assert got.token_ids == ref.token_ids[: len(got.token_ids)]
            else:
                assert got.token_ids == ref.token_ids, i


def test_draft_model_config_errors(tiny_hf_checkpoints, tiny_vocab_draft, tmp_path):
    _, directory = tiny_hf_checkpoints("qwen3")
    with pytest.raises(ValueError, match="speculative_draft_model_path"):
        EngineConfig(model_path=str(directory), speculative_method="draft")
    with pytest.raises(ValueError, match="set it to 'draft'"):
        EngineConfig(
            model_path=str(directory), speculative_method="group", speculative_draft_model_path="x"
        )
    with pytest.raises(FileNotFoundError, match="speculative_draft_model_path"):
        Engine(spec_config("draft", str(tmp_path / "missing"), model_path=str(directory)))
    with pytest.raises(ValueError, match="vocab_size 6 differs from the target's 101"):
        Engine(spec_config("draft", tiny_vocab_draft, model_path=str(directory)))


def test_backoff_pauses_drafting_after_failed_drafts():
    backoff = DraftBackoff(min_acceptance=0.25, max_pause=8)
    pattern = []
    for _ in range(30):  # drafts that never land: pauses 1, 2, 4, 8, 8, ... steps
        drafting = backoff.should_draft()
        pattern.append(drafting)
        if drafting:
            backoff.record(drafted=4, accepted=0)
    gaps = [len(run) for run in "".join("d" if d else "." for d in pattern).split("d")[1:-1]]
    assert gaps == [1, 2, 4, 8, 8], pattern
    while not backoff.should_draft():  # sit out the current pause
        pass
    backoff.record(drafted=4, accepted=1)  # a draft that lands ends the back-off
    assert backoff.pause == 0 and backoff.should_draft()
    never = DraftBackoff(min_acceptance=0.0)
    never.record(drafted=4, accepted=0)
    assert never.should_draft()


def test_backoff_limits_wasted_drafts_on_a_near_uniform_model(tiny_vocab_model):
    """On prompts whose n-grams never recur in what the model samples, lookup drafts keep failing;
    with the back-off far fewer are verified than without it, and outputs keep their distribution
    (the sampler's exactness is the chi-square test above)."""
    _, directory = tiny_vocab_model
    prompts = [PROMPT] * 8
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=40, ignore_eos=True, seed=3)
    drafted = {}
    for min_acceptance in (0.0, 0.5):
        engine = Engine(
            EngineConfig(
                model_path=str(directory),
                speculative_method="group",
                speculative_min_acceptance=min_acceptance,
            )
        )
        engine.generate(prompts, params)
        drafted[min_acceptance] = engine.stats()
    assert drafted[0.5]["spec_backoff_steps"] > 0
    assert drafted[0.5]["spec_verify_steps"] < 0.7 * drafted[0.0]["spec_verify_steps"], drafted


def test_draft_model_pool_follows_release_and_resume(tiny_hf_checkpoints, qwen3_draft):
    _, directory = tiny_hf_checkpoints("qwen3")
    engine = Engine(
        spec_config("draft", qwen3_draft, model_path=str(directory), kv_cache_tokens=256)
    )
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    first = engine.generate([[3, 1, 4, 1, 5]], params)
    pool = engine.draft_model.pool
    draft_bytes = 2 * pool.k.numel() * pool.k.element_size()
    target_bytes = 2 * engine.pool.k.numel() * engine.pool.k.element_size()
    assert engine.release_memory() == target_bytes + draft_bytes
    assert not pool.allocated
    engine.resume_memory()
    assert engine.generate([[3, 1, 4, 1, 5]], params) == first
    engine.check_integrity()


@pytest.mark.parametrize("method", ["off", "ngram", "group", "draft"])
def test_seeded_sampling_repeats_on_a_fresh_engine(tiny_hf_checkpoints, qwen3_draft, method):
    """The same seeded requests on two fresh, identical engines give the same tokens, with every
    proposer. Several rounds of a GRPO-like workload (n samples per prompt, the prompts coming
    back) free sequences while others start, so any state keyed by an object's address (which
    CPython reuses) would differ between the two engines."""
    _, directory = tiny_hf_checkpoints("qwen3")
    g = torch.Generator().manual_seed(11)
    motif = torch.randint(0, 101, (4,), generator=g).tolist()
    prompts = [motif * 3 + torch.randint(0, 101, (k,), generator=g).tolist() for k in (2, 5, 7)]
    rounds = [
        [
            SamplingParams(
                n=4, temperature=1.0, max_new_tokens=int(m), ignore_eos=True, seed=100 * r + i
            )
            for i, m in enumerate((12, 20, 28))
        ]
        for r in range(4)
    ]

    def run() -> tuple[list[list[int]], dict]:
        config = (
            EngineConfig(model_path=str(directory), page_size=2)
            if method == "off"
            else spec_config(method, qwen3_draft, model_path=str(directory), page_size=2)
        )
        engine = Engine(config)
        tokens = [
            s.token_ids
            for params in rounds
            for per in engine.generate(prompts, params)
            for s in per
        ]
        return tokens, engine.stats()

    (first, stats), (second, _) = run(), run()
    if method != "off":
        assert stats["spec_accepted_tokens"] > 0  # the proposer really drafted
    assert first == second
