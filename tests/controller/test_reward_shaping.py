"""DAPO's overlong penalty and dynamic-sampling filter, by hand."""

from __future__ import annotations

import pytest
import torch

from miles_like.scoring.shaping import informative_groups, overlong_penalty


def test_overlong_penalty_piecewise_linear():
    # max 12, buffer 4: free up to 8 tokens, then -1/4 per token down to -1 at 12
    out = overlong_penalty(torch.tensor([1, 8, 9, 10, 12]), max_new_tokens=12, buffer=4)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0]))
    out = overlong_penalty(torch.tensor([10]), max_new_tokens=12, buffer=4, factor=2.0)
    torch.testing.assert_close(out, torch.tensor([-1.0]))


def test_overlong_penalty_off_and_bad_buffer():
    torch.testing.assert_close(overlong_penalty(torch.tensor([12]), 12, 0), torch.tensor([0.0]))
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(torch.tensor([1]), 12, 12)


def test_informative_groups():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [2.0, 2.0, 2.0], [0.0, 0.0, 0.5]])
    assert informative_groups(rewards).tolist() == [False, True, False, True]
