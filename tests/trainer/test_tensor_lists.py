"""An RLBatch pickles each per-token field as one flat tensor (`trainer.tensor_lists`) and comes
back exactly: every field, every value bitwise, every dtype; what cannot be packed travels as
it is."""

import io
import pickle
import random

import torch

from trainer import RLBatch
from trainer.tensor_lists import PackedTensors, pack, unpack


def random_batch(samples: int = 40, seed: int = 0) -> RLBatch:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tokens, prompt_lens = [], []
    for _ in range(samples):
        prompt, response = rng.randint(1, 9), rng.randint(0, 12)  # empty responses too
        tokens.append([rng.randrange(50) for _ in range(prompt + response)])
        prompt_lens.append(prompt)

    def field(dtype):
        return [
            torch.randn(len(t) - p, generator=gen, dtype=torch.float64).to(dtype)
            for t, p in zip(tokens, prompt_lens)
        ]

    return RLBatch(
        tokens=tokens,
        prompt_lens=prompt_lens,
        advantages=field(torch.float32),
        rollout_logprobs=field(torch.float64),
        loss_masks=[(v > 0).float() for v in field(torch.float32)],
        old_logprobs=field(torch.bfloat16),
    )


def tensors_pickled(obj) -> int:
    """How many tensor objects pickling `obj` serialises."""
    count = 0

    class Counting(pickle.Pickler):
        def reducer_override(self, value):
            nonlocal count
            count += isinstance(value, torch.Tensor)
            return NotImplemented

    Counting(io.BytesIO(), protocol=5).dump(obj)
    return count


def assert_same_batch(got: RLBatch, want: RLBatch) -> None:
    assert got.tokens == want.tokens and got.prompt_lens == want.prompt_lens
    for name in RLBatch._PER_TOKEN:
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert len(a) == len(b), name
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x, y), name


def test_batch_round_trips_exactly_as_one_tensor_per_field():
    batch = random_batch()
    back = pickle.loads(pickle.dumps(batch))
    assert_same_batch(back, batch)
    # four per-token fields set: four tensors, not one per sample and field (160)
    assert tensors_pickled(batch) == 4
    assert tensors_pickled(batch.advantages) == len(batch.tokens)


def test_unpacked_tensors_are_disjoint():
    batch = random_batch(samples=5)
    back = pickle.loads(pickle.dumps(batch))
    before = [t.clone() for t in back.advantages]
    back.advantages[2].add_(1.0)  # an in-place op on one sample leaves the others alone
    for i, (t, b) in enumerate(zip(back.advantages, before)):
        assert torch.equal(t, b + 1.0 if i == 2 else b)


def test_what_cannot_be_packed_travels_unchanged():
    two_d = [torch.ones(2, 3), torch.zeros(1, 3)]
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.float64)]
    grad = [torch.ones(2, requires_grad=True)]
    for values in (two_d, mixed, grad, [], None):
        assert pack(values) is values
    packed = pack([torch.arange(3.0), torch.arange(2.0)])
    assert isinstance(packed, PackedTensors) and packed.lengths == [3, 2]
    assert [t.tolist() for t in unpack(packed)] == [[0.0, 1.0, 2.0], [0.0, 1.0]]
    # a batch with a field that cannot be packed still round-trips
    batch = random_batch(samples=3)
    lps = list(batch.rollout_logprobs)
    lps[1] = lps[1].float()  # mixed dtypes in one field
    mixed_batch = RLBatch(tokens=batch.tokens, prompt_lens=batch.prompt_lens, rollout_logprobs=lps)
    assert_same_batch(pickle.loads(pickle.dumps(mixed_batch)), mixed_batch)
    assert tensors_pickled(mixed_batch) == 3
