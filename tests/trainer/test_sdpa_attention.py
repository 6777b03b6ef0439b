"""Packed (thd) core attention: sequences bucketed by length and padded into batched calls give
what attending to each sequence alone gives, values and gradients (float64, to rounding)."""

from __future__ import annotations

import torch

from trainer.sdpa_attention import packed_causal_attention


def one_by_one(query, key, value, bounds, scale):
    """The reference: each sequence its own causal SDPA call (GQA by repeating KV heads)."""
    reps = query.shape[1] // key.shape[1]
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        q = query[start:end].transpose(0, 1)
        k, v = (x[start:end].transpose(0, 1).repeat_interleave(reps, 0) for x in (key, value))
        scores = (q @ k.transpose(-1, -2)) * scale
        causal = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        outs.append((probs @ v).transpose(0, 1))
    return torch.cat(outs)


def test_bucketed_packed_attention_equals_one_call_per_sequence():
    g = torch.Generator().manual_seed(0)
    # lengths spread over several power-of-two buckets, a length-1 sequence, ties
    lengths = [1, 7, 3, 16, 17, 5, 8, 2, 33, 4, 9]
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    t, heads, groups, d = bounds[-1], 4, 2, 8
    q, k, v = (
        torch.randn(t, n, d, generator=g, dtype=torch.float64, requires_grad=True)
        for n in (heads, groups, groups)
    )
    scale = d**-0.5
    got = packed_causal_attention(q, k, v, torch.tensor(bounds, dtype=torch.int32), scale)
    want = one_by_one(q, k, v, bounds, scale)
    assert got.shape == want.shape == (t, heads, d)
    assert float((got - want).detach().abs().max()) <= 1e-12
    upstream = torch.randn(t, heads, d, generator=g, dtype=torch.float64)
    grads_got = torch.autograd.grad(got, (q, k, v), upstream)
    grads_want = torch.autograd.grad(want, (q, k, v), upstream)
    for a, b in zip(grads_got, grads_want):
        assert float((a - b).abs().max()) <= 1e-12


def test_one_token_sequences_attend_to_themselves_only():
    v = torch.arange(12, dtype=torch.float64).view(3, 1, 4)
    out = packed_causal_attention(
        torch.zeros(3, 2, 4, dtype=torch.float64),
        torch.zeros(3, 1, 4, dtype=torch.float64),
        v,
        torch.tensor([0, 1, 2, 3]),
        1.0,
    )
    assert torch.equal(out, v.expand(3, 2, 4))


def test_equal_length_runs_take_a_view_and_equal_one_call_per_sequence():
    """Consecutive equal-length sequences (a fixed-length RL batch) are attended as a view of
    the packed rows, with no gather; values and gradients equal the reference, alone and
    mixed with padded buckets whose output rows must be put back in packed order."""
    from trainer.sdpa_attention import _packing_plan

    g = torch.Generator().manual_seed(1)
    for lengths in ([8, 8, 8, 8], [8, 3, 8, 8, 2]):
        bounds = [0]
        for n in lengths:
            bounds.append(bounds[-1] + n)
        cu = torch.tensor(bounds, dtype=torch.int32)
        plan = _packing_plan(cu, torch.device("cpu"))
        assert (plan.dest is None) == (lengths == [8, 8, 8, 8])
        t, heads, groups, d = bounds[-1], 4, 2, 8
        q, k, v = (
            torch.randn(t, n, d, generator=g, dtype=torch.float64, requires_grad=True)
            for n in (heads, groups, groups)
        )
        got = packed_causal_attention(q, k, v, cu, d**-0.5)
        want = one_by_one(q, k, v, bounds, d**-0.5)
        assert float((got - want).detach().abs().max()) <= 1e-12
        upstream = torch.randn(t, heads, d, generator=g, dtype=torch.float64)
        for a, b in zip(
            torch.autograd.grad(got, (q, k, v), upstream),
            torch.autograd.grad(want, (q, k, v), upstream),
        ):
            assert float((a - b).abs().max()) <= 1e-12


def test_mixed_lengths_backward_moves_rows_without_scatter_add():
    """Padding into buckets and back is a permutation-like move of rows: its backward must
    not fall back to index_select's scatter-add (the largest cost of a mixed-length step)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.Generator().manual_seed(2)
    bounds = [0, 5, 17, 20, 36, 39]
    q, k, v = (
        torch.randn(39, n, 8, generator=g, dtype=torch.float64, requires_grad=True)
        for n in (4, 2, 2)
    )
    cu = torch.tensor(bounds, dtype=torch.int32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = packed_causal_attention(q, k, v, cu, 8**-0.5)
        out.backward(torch.randn(out.shape, generator=g, dtype=torch.float64))
    ops = {e.key for e in prof.key_averages()}
    assert "aten::index_copy_" in ops  # the padding ran (a mixed-length plan)
    assert not ops & {"aten::scatter_add_", "aten::index_add_", "aten::index_put_"}, ops
    want = one_by_one(q, k, v, bounds, 8**-0.5)
    assert float((out - want).detach().abs().max()) <= 1e-12
