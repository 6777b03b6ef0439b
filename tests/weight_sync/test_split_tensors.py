"""Tensors larger than a bucket, cut into pieces (`BucketPacker(split_tensors=True)`).

References: the tensors themselves (the pieces put back together, and the engine's parameters
after a sync, bitwise), a fresh engine loaded from the same weights on disk (identical greedy
outputs), and the engine's parameters before the sync (a corrupted bucket leaves every element
it carried at its old value).
"""

from __future__ import annotations

import math

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.weights import iter_safetensors
from weight_sync import BucketPacker, BucketReceiver, ColocatedSender, Done, WeightSyncError

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
BUCKET = 12 << 10  # the tiny model's embedding, MLP and q/o weights are larger


def _engine(path) -> Engine:
    return Engine(EngineConfig(model_path=str(path)))


class WholeTensorsOnly:
    """A receiver target that takes whole tensors only (no `load_weight_piece`), as a TP
    follower's own shards do: the pieces are assembled before they reach it."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loads: list[list[str]] = []

    def load_weights(self, named_tensors):
        named_tensors = list(named_tensors)
        self.loads.append([name for name, _ in named_tensors])
        self.engine.load_weights(named_tensors)

    def commit_weights(self):
        self.engine.commit_weights()


def test_every_bucket_fits_and_the_pieces_rebuild_each_tensor_bitwise():
    g = torch.Generator().manual_seed(0)
    tensors = [
        ("big", torch.randn(10_000, generator=g)),  # 40 000 bytes: 9 pieces of 1 024 floats + 784
        ("small", torch.randn(7, generator=g)),
        ("matrix", torch.randn(33, 65, generator=g).to(torch.bfloat16)),  # 4 290 bytes
        ("exact", torch.randn(2048, generator=g)),  # twice the bucket exactly: 2 pieces
        ("tail", torch.randn(3, generator=g)),
    ]
    packer = BucketPacker(bucket_bytes=4096, split_tensors=True)
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    shapes = {}
    for buffer, manifest in packer.pack(tensors):
        assert manifest.nbytes <= 4096
        for e in manifest.entries:
            view = buffer[e.offset : e.offset + e.numel].clone()  # the buffers are reused
            parts.setdefault(e.name, []).append((e.start, view))
            shapes[e.name] = e.shape
            assert e.whole == (e.start == 0 and e.numel == math.prod(e.shape))
    for name, tensor in tensors:
        pieces = sorted(parts[name], key=lambda part: part[0])
        starts = [s for s, _ in pieces]
        ends = [s + v.numel() for s, v in pieces]
        assert starts == [0] + ends[:-1] and ends[-1] == tensor.numel(), name  # in order, no gap
        rebuilt = torch.cat([v for _, v in pieces]).view(shapes[name])
        assert rebuilt.dtype == tensor.dtype and torch.equal(rebuilt, tensor), name
    assert len(parts["big"]) == 10 and len(parts["exact"]) == 2 and len(parts["small"]) == 1


def test_without_split_an_oversize_tensor_keeps_a_bucket_of_its_own():
    tensors = [("a", torch.ones(3)), ("big", torch.arange(2000.0)), ("b", torch.zeros(2))]
    buckets = list(BucketPacker(bucket_bytes=1024).pack(tensors))
    assert [[e.name for e in m.entries] for _, m in buckets] == [["a"], ["big"], ["b"]]
    assert all(e.whole for _, m in buckets for e in m.entries)


@pytest.mark.parametrize("target", ["engine", "whole tensors only"])
def test_split_sync_updates_engine_bitwise(two_checkpoints, target):
    """Into the engine's parameters piece by piece (`Engine.load_weight_piece`), or through a
    receiver target without it (each tensor assembled, then loaded whole)."""
    old, new = two_checkpoints
    engine = _engine(old)
    receiver_target = engine if target == "engine" else WholeTensorsOnly(engine)
    receiver = BucketReceiver(receiver_target)
    manifests = []

    def deliver(handle, manifest):
        manifests.append(manifest)
        return Done(receiver.load(handle, manifest))

    sender = ColocatedSender(deliver, bucket_bytes=BUCKET, split_tensors=True, num_buffers=3)
    new_weights = dict(iter_safetensors(new))
    report = sender.send(new_weights.items())
    receiver.commit()
    sender.close()
    split = {e.name for m in manifests for e in m.entries if not e.whole}
    assert "model.embed_tokens.weight" in split and len(split) > 10  # not vacuous
    assert all(m.nbytes <= BUCKET for m in manifests)
    params = dict(engine.model.named_parameters())
    for name, tensor in new_weights.items():
        assert torch.equal(params[name], tensor), name
    assert engine.weight_version == 1 and report.nbytes == sum(
        t.nbytes for t in new_weights.values()
    )
    if target == "whole tensors only":  # each split tensor loaded once, whole
        loaded = [name for names in receiver_target.loads for name in names]
        assert sorted(loaded) == sorted(new_weights)
    assert engine.generate(PROMPTS, GREEDY) == _engine(new).generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("target", ["engine", "whole tensors only"])
def test_a_corrupted_piece_leaves_its_whole_bucket_unloaded(two_checkpoints, target):
    """One flipped bit in the middle piece of the embedding: the error names it, none of the
    elements that bucket carried changed, the pieces before it (earlier buckets) are in."""
    old, new = two_checkpoints
    weights = list(iter_safetensors(new))
    engine = _engine(old)
    before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    receiver = BucketReceiver(engine if target == "engine" else WholeTensorsOnly(engine))
    loaded, corrupted = [], []

    def corrupting_deliver(handle, manifest):
        entry = manifest.entries[0]
        if not corrupted and entry.name == "model.embed_tokens.weight" and entry.start > 0:
            buffer = receiver.opener.open(handle)
            buffer[entry.offset + entry.numel // 2 :][:1].view(torch.uint8)[0] ^= 0x01
            corrupted.append(manifest)
        else:
            loaded.append(manifest)
        return Done(receiver.load(handle, manifest))

    sender = ColocatedSender(corrupting_deliver, bucket_bytes=BUCKET, split_tensors=True)
    with pytest.raises(WeightSyncError, match="checksum mismatch") as err:
        sender.send(weights)
    sender.close()
    (bucket,) = corrupted
    assert "model.embed_tokens.weight" in str(err.value)
    params, new_values = dict(engine.model.named_parameters()), dict(weights)

    def elements(values: dict, e) -> torch.Tensor:
        return values[e.name].reshape(-1)[e.start : e.start + e.numel]

    assert any(
        not torch.equal(elements(before, e), elements(new_values, e)) for e in bucket.entries
    )
    for e in bucket.entries:  # nothing of the corrupted bucket was loaded
        assert torch.equal(elements(params, e), elements(before, e)), (e.name, e.start)
    if target == "engine":  # the buckets before it were, pieces included
        for e in (e for m in loaded for e in m.entries):
            assert torch.equal(elements(params, e), elements(new_values, e)), (e.name, e.start)
    with pytest.raises(RuntimeError, match="commit_weights"):  # half-updated engine refuses
        engine.generate(PROMPTS, GREEDY)


def test_the_engine_takes_a_piece_in_place_only_as_a_plain_copy(two_checkpoints):
    """`Engine.load_weight_piece`: a weight of another dtype or shape, or an unknown name, is
    refused with nothing written (the receiver then assembles it); a range outside the weight is
    an error; the last piece completes the weight."""
    old, _ = two_checkpoints
    engine = _engine(old)
    name = "model.embed_tokens.weight"
    param = dict(engine.model.named_parameters())[name]
    saved = param.detach().clone()
    shape = tuple(param.shape)
    piece = torch.full((10,), 0.5)
    assert not engine.load_weight_piece(name, shape, 0, piece.to(torch.bfloat16))
    assert not engine.load_weight_piece(name, (shape[0] + 1, shape[1]), 0, piece)
    assert not engine.load_weight_piece("model.no_such.weight", shape, 0, piece)
    assert torch.equal(param, saved)
    with pytest.raises(ValueError, match="outside"):
        engine.load_weight_piece(name, shape, param.numel() - 5, piece)
    assert engine.load_weight_piece(name, shape, 20, piece)
    assert torch.equal(param.reshape(-1)[20:30], piece)
    assert torch.equal(param.reshape(-1)[:20], saved.reshape(-1)[:20])
    with pytest.raises(RuntimeError, match="commit_weights"):
        engine.generate(PROMPTS, GREEDY)
    engine.commit_weights()
    assert engine.weight_version == 1


@pytest.mark.parametrize("target", ["engine", "whole tensors only"])
def test_a_sync_cut_short_is_refused_at_commit(two_checkpoints, target):
    """Pieces of a tensor whose remaining pieces never came, staged or already written in place:
    the commit refuses, naming it, and the half-updated engine generates nothing."""
    old, new = two_checkpoints
    engine = _engine(old)
    receiver = BucketReceiver(engine if target == "engine" else WholeTensorsOnly(engine))
    packer = BucketPacker(BUCKET, split_tensors=True)
    for buffer, manifest in packer.pack(iter_safetensors(new)):
        receiver.load_buffer(buffer, manifest)
        if any(not e.whole and e.name == "model.embed_tokens.weight" for e in manifest.entries):
            break  # the embedding's first piece only
    with pytest.raises(WeightSyncError, match="model.embed_tokens.weight"):
        receiver.commit()
    assert engine.weight_version == 0
    with pytest.raises(RuntimeError, match="commit_weights"):
        engine.generate(PROMPTS, GREEDY)
