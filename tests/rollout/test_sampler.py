"""The sampler's inverse-CDF draw against the rule written out in full: the first token whose
cumulative mass exceeds u * total, or, when rounding puts u * total at the total, the last token
of positive mass (never a zero-probability token)."""

import torch

from rollout.sampler import SamplingBatch, _sample_torch, sample, truncation_mask
from rollout.uniform_stream import UniformStream


def reference_draw(probs: torch.Tensor, u: float) -> int:
    cdf = probs.cumsum(-1)
    threshold = torch.tensor(u, dtype=torch.float64).to(cdf.dtype) * cdf[-1]
    choice = int(torch.searchsorted(cdf, threshold.view(1), right=True))
    return min(choice, int((cdf < cdf[-1]).sum()))


def _batch(
    rows: int, uniforms: list[float], temperature: float = 1.0, top_k: int = -1
) -> SamplingBatch:
    return SamplingBatch(
        temperature=torch.full((rows,), temperature),
        top_p=torch.ones(rows),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        min_p=torch.zeros(rows),
        uniforms=torch.tensor(uniforms, dtype=torch.float64),
    )


def test_draws_follow_the_rule_including_rounding_at_the_total():
    g = torch.Generator().manual_seed(0)
    rows, vocab = 64, 50
    logits = torch.randn(rows, vocab, generator=g) * 3
    logits[:, -7:] = float("-inf")  # trailing zero-probability tokens
    uniforms = torch.rand(rows, generator=g, dtype=torch.float64)
    uniforms[:8] = 1 - 2.0**-53  # rounds to 1.0 in float32: threshold == total
    for temperature, top_k in ((1.0, -1), (0.7, -1), (1.0, 5)):
        tokens, logprobs = sample(logits, _batch(rows, uniforms.tolist(), temperature, top_k))
        scaled = torch.log_softmax(logits / temperature, -1)
        for r in range(rows):
            probs = scaled[r].exp()
            if top_k > 0:
                probs = (
                    probs
                    * truncation_mask(
                        probs[None], torch.tensor([top_k]), torch.ones(1), torch.zeros(1)
                    )[0]
                )
            assert int(tokens[r]) == reference_draw(probs, float(uniforms[r]))
            # one pass: log_softmax's formula, its sum in another order (test_sampler_one_pass)
            assert abs(float(logprobs[r]) - float(scaled[r, tokens[r]])) < 1e-5
        assert (tokens[:8] < vocab - 7).all()  # never a zero-probability token
    assert torch.tensor(1 - 2.0**-53).float() == 1.0  # the first rows did hit the total


def test_mixed_greedy_and_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 30, generator=g)
    batch = _batch(4, [0.1, 0.5, 0.9, 0.3])
    batch = batch._replace(temperature=torch.tensor([0.0, 1.0, 0.0, 1.0]))
    tokens, _ = sample(logits, batch)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()
    for r in (1, 3):
        assert int(tokens[r]) == reference_draw(
            torch.softmax(logits[r], -1), float(batch.uniforms[r])
        )


def test_a_uniform_stream_is_its_generators_draws_one_at_a_time():
    """Drawn a block at a time, the stream is exactly the sequence of one-draw
    `torch.rand((), generator=g, dtype=float64)` calls on the same seed, across block ends."""
    for seed in (0, 7, 2**40 + 3):
        stream = UniformStream(seed)
        g = torch.Generator().manual_seed(seed)
        draws = [stream.draw() for _ in range(3 * UniformStream.BLOCK + 5)]
        expected = [
            torch.rand((), generator=g, dtype=torch.float64).item() for _ in range(len(draws))
        ]
        assert draws == expected


def test_a_shared_setting_knows_the_kernel_rows_as_the_per_row_check_does():
    """`SamplingBatch.of` marks a batch `plain` (and its other host-side flags) from its
    settings; that must be the per-row check `sample` would make on the tensors (temperature >
    0, no truncation, in float32), and the flags must not change what is drawn. Settings sharing
    one value through different objects count as one setting; two settings never do."""
    from rollout.config import SamplingParams
    from rollout.sampler import _truncating
    from rollout.sequence import Request, Sequence

    vocab = 300
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(3))
    settings = [
        dict(temperature=1.0),
        dict(temperature=0.7),
        dict(temperature=1e-50),  # positive, 0 in float32: greedy rows
        dict(temperature=0.0),
        dict(temperature=1.0, top_p=0.9),
        dict(temperature=1.0, top_p=1 - 1e-9),  # 1 in float32: no truncation
        dict(temperature=1.0, top_k=5),
        dict(temperature=1.0, min_p=0.1),
    ]
    for kw in settings:
        # two requests with equal but distinct parameter objects, three samples each
        seqs = [
            Sequence(Request(r, [1, 2], SamplingParams(n=3, **kw), base_seed=10 * r), j)
            for r in range(2)
            for j in range(3)
        ]
        batch = SamplingBatch.of(seqs)
        per_row = (batch.temperature > 0) & ~_truncating(
            batch.top_k, batch.top_p, batch.min_p, vocab
        )
        assert batch.plain == bool(per_row.all()), kw
        assert_flags_match_rows(batch, vocab, kw)
        unmarked = batch._replace(
            plain=False,
            all_sampled=False,
            all_greedy=False,
            unit_temperature=False,
            no_truncation=False,
        )
        for a, b in zip(sample(logits, batch), sample(logits, unmarked)):
            assert torch.equal(a, b), kw
        # the torch path (any device) too, which branches on the same flags
        for a, b in zip(_sample_torch(logits, batch), _sample_torch(logits, unmarked)):
            assert torch.equal(a, b), kw
    two = [
        Sequence(Request(r, [1, 2], SamplingParams(temperature=t, top_k=k), base_seed=r), 0)
        for r, (t, k) in enumerate(((1.0, -1), (0.5, -1), (0.0, -1), (1.0, 5)))
    ]
    for rows in ([0, 1], [0, 2], [2, 3], [0, 1, 2, 3]):
        mixed = SamplingBatch.of([two[r] for r in rows])
        assert mixed.temperature.tolist() == [[1.0, 0.5, 0.0, 1.0][r] for r in rows]
        assert_flags_match_rows(mixed, vocab, rows)
    assert SamplingBatch.of(two[:2]).plain and not SamplingBatch.of(two[:3]).plain


def assert_flags_match_rows(batch: SamplingBatch, vocab: int, what) -> None:
    """Each host-side flag of `batch` is the per-row check on its tensors."""
    from rollout.sampler import _truncating

    truncating = _truncating(batch.top_k, batch.top_p, batch.min_p, vocab)
    assert batch.all_sampled == bool((batch.temperature > 0).all()), what
    assert batch.all_greedy == bool((batch.temperature == 0).all()), what
    assert batch.unit_temperature == bool((batch.temperature == 1).all()), what
    # a top-k at or above the vocabulary truncates nothing but is set: the flag is a fact
    assert not batch.no_truncation or not bool(truncating.any()), what


def test_peeking_a_uniform_stream_then_skipping_is_drawing():
    """`peek(n)` shows the next n draws without taking them (across block ends) and `skip(n)`
    takes them: interleaved with `draw`, the stream is still its generator's draws in order."""
    stream, reference = UniformStream(5), UniformStream(5)
    g = torch.Generator().manual_seed(3)
    for _ in range(200):
        n = int(torch.randint(0, 9, (), generator=g))
        ahead = stream.peek(n)
        taken = int(torch.randint(0, n + 1, (), generator=g))
        stream.skip(taken)
        expected = [reference.draw() for _ in range(taken)]
        assert ahead[:taken] == expected
        assert stream.peek(n - taken) == ahead[taken:]
        assert stream.draw() == reference.draw()
