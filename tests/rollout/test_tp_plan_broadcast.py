"""Engine TP sends each step's plan as tensors, not as a pickle.

`TPGroup.send` on rank 0 and `TPGroup.receive` on a follower, joined by a recording wire in
place of torch.distributed's `broadcast_object_list` / `broadcast` (one process, a one-rank
gloo world with the group size read as 2): what goes through `broadcast_object_list` is small
and holds no tensor; the tensors go through `broadcast`; the command that arrives equals the one
sent, tensor for tensor, and the model's forward of the received plan gives the same logits. The
plan is a real one: 64 decoding sequences of a tiny engine (their [D, Q, width] suffix bias
included) with a prefill chunk after a cached prefix.
"""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch
import torch.distributed as dist

import collectives.ops
from rollout import Engine, EngineConfig, SamplingParams
from rollout.model_runner import execute
from rollout.tp_group import Forward, TPGroup

HEADER_MAX_BYTES = 4096


def leaves(obj, path="command"):
    """(path, value) of every leaf of a tree of NamedTuples, dataclasses, tuples and lists."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from leaves(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, tuple) and hasattr(obj, "_fields"):
        for name in obj._fields:
            yield from leaves(getattr(obj, name), f"{path}.{name}")
    elif isinstance(obj, (tuple, list)):
        for i, x in enumerate(obj):
            yield from leaves(x, f"{path}[{i}]")
    else:
        yield path, obj


class RecordingWire:
    """torch.distributed's broadcasts between one sender and one receiver in one process:
    while `sending`, each call is recorded; then each call replays the next record."""

    def __init__(self):
        self.sending = True
        self.objects: list[bytes] = []
        self.tensors: list[torch.Tensor] = []

    def broadcast_object_list(self, box, group=None, group_src=0, **kwargs):
        if self.sending:
            self.objects.append(pickle.dumps(box[0]))
        else:
            box[0] = pickle.loads(self.objects.pop(0))

    def broadcast(self, tensor, group=None, group_src=0, **kwargs):
        if self.sending:
            self.tensors.append(tensor.clone())
        else:
            tensor.copy_(self.tensors.pop(0))


@pytest.fixture
def wire(monkeypatch):
    # a world of one is all the recording needs: an earlier test in this process may have left
    # one (a trainer built in-process does), which is used as it is and left as it was
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1, "a world of one: the wire is recorded, not sent"
    recording = RecordingWire()
    monkeypatch.setattr(collectives.ops, "size", lambda group=None: 2)
    monkeypatch.setattr(dist, "broadcast_object_list", recording.broadcast_object_list)
    monkeypatch.setattr(dist, "broadcast", recording.broadcast)
    try:
        yield recording
    finally:
        if owned:
            dist.destroy_process_group()


def a_step_plan(directory):
    """The engine, and the plan of one step: 64 decoding sequences (forks of prompts sharing a
    prefix) and a new prompt whose first pages are cached."""
    engine = Engine(EngineConfig(model_path=str(directory), page_size=2))
    prefix = [5, 9, 2, 7, 11, 3, 8, 1]
    params = SamplingParams(n=16, temperature=1.0, max_new_tokens=32, ignore_eos=True, seed=0)
    for tail in ([4], [6, 12], [13], [14, 15, 16]):
        engine.add_request(prefix + tail, params)
    while engine.scheduler.waiting or any(s.num_generated < 2 for s in engine.scheduler.running):
        engine.step()
    engine.add_request(prefix + [17, 18, 19], SamplingParams(max_new_tokens=4, seed=1))
    batch = engine.scheduler.schedule()
    assert len(batch.decode) == 64 and batch.prefill, "the step mixes decode and a prefix chunk"
    return engine, engine.runner.prepare(batch)


@torch.inference_mode()
def test_a_step_plan_travels_as_tensors(tiny_hf_checkpoints, wire):
    _, directory = tiny_hf_checkpoints("qwen3")
    engine, plan = a_step_plan(directory)
    assert any(seg.prefix_len > 0 for seg in plan.meta.prefill)
    command = Forward(plan, ((1, 2, 1),))
    tp = TPGroup()

    tp.send(command)
    sent_tensors = [v for _, v in leaves(command) if isinstance(v, torch.Tensor)]
    for pickled in wire.objects:
        assert len(pickled) <= HEADER_MAX_BYTES, f"{len(pickled)} bytes pickled"
        inside = [p for p, v in leaves(pickle.loads(pickled)) if isinstance(v, torch.Tensor)]
        assert not inside, f"tensors pickled: {inside}"
    sent_bytes = sum(t.numel() * t.element_size() for t in sent_tensors)
    assert sum(t.numel() * t.element_size() for t in wire.tensors) == sent_bytes
    assert len(wire.tensors) <= 4, "small tensors travel packed, one broadcast per dtype"

    wire.sending = False
    received = tp.receive(torch.device("cpu"))
    assert not wire.objects and not wire.tensors, "the follower read everything sent"
    sent, got = list(leaves(command)), list(leaves(received))
    assert [p for p, _ in sent] == [p for p, _ in got]
    for (path, a), (_, b) in zip(sent, got):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), path
        else:
            assert a == b, path

    want = execute(engine.model, engine.runner.attention, plan)
    assert torch.equal(execute(engine.model, engine.runner.attention, received.plan), want)
