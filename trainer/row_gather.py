"""Row gathers and scatters whose backward is a scatter, not a scatter-add.

`x.index_select(0, index)`'s backward accumulates with an index_add (atomic-style), the largest
cost of a step on mixed lengths. When `index` has no repeats each gradient row has exactly one
source row, so a plain `index_copy_` into zeros is the same gradient."""

from __future__ import annotations

import torch


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0, for an `index` without repeats."""
    return _GatherRows.apply(x, index)


def scatter_rows(x: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of `x` written to rows `index` (no repeats) of a zero tensor of `rows` rows: the
    adjoint of `gather_rows`."""
    return _ScatterRows.apply(x, index, rows)


class _GatherRows(torch.autograd.Function):
    """x[index] along dim 0 for an `index` without repeats. Its backward writes each gradient
    row to its one source row (`_ScatterRows`), where `index_select`'s backward is a
    scatter-add (atomic-style accumulation, the step's largest cost on mixed lengths)."""

    @staticmethod
    def forward(ctx, x, index):
        ctx.save_for_backward(index)
        ctx.rows = x.size(0)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return scatter_rows(grad, index, ctx.rows), None


class _ScatterRows(torch.autograd.Function):
    """Rows of x written to rows `index` (no repeats) of a zero tensor of `rows` rows; the
    adjoint of `_GatherRows`."""

    @staticmethod
    def forward(ctx, x, index, rows: int):
        ctx.save_for_backward(index)
        out = x.new_zeros(rows, *x.shape[1:])
        return out.index_copy_(0, index, x)

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        return gather_rows(grad, index), None, None
