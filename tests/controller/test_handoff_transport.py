"""How handoffs travel between a prefill and a decode engine actor (`run.handoff_transport`).

The reference is the library's own handoff (`rollout.prefill_decode.prefill`) and one engine
doing both: a handoff shared by `HandoffSender` and opened by `HandoffReceiver` in another
process has the same tensors, bitwise, as the one shared, and a decode engine there samples
what one engine samples. The CPU path (POSIX shared memory) runs everywhere; the CUDA IPC path
(the same code on a GPU) runs where a GPU is. Buffers whose sender freed them (its actor died)
raise `HandoffGone`, the batcher's cue to prefill again.
"""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.multiprocessing as mp

from miles_like.run.handoff_transport import HandoffGone, HandoffReceiver, HandoffSender, nbytes
from rollout import Engine, EngineConfig, SamplingParams
from rollout.prefill_decode import prefill

from tiny_hf import make_hf_model, save_hf_model

PROMPTS = [[3, 17, 5, 29, 11, 7, 23, 2, 41], [43, 8, 61, 4, 9]]
PARAMS = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_new_tokens=6, seed=5)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(save_hf_model(make_hf_model("qwen3_moe", seed=0), tmp_path_factory.mktemp("moe")))


def make_engine(directory: str, device: str = "cpu") -> Engine:
    return Engine(
        EngineConfig(
            model_path=directory,
            dtype="float64",
            kv_cache_tokens=256,
            page_size=4,
            seed=0,
            device=device,
        )
    )


def _decode_in_child(directory, device, shared_bytes, conn) -> None:
    try:
        torch.set_num_threads(1)
        receiver = HandoffReceiver(device)
        handoffs = receiver.open(pickle.loads(shared_bytes))
        engine = make_engine(directory, device)
        ids = [engine.admit_prefilled(h, PARAMS) for h in handoffs]
        done = {}
        while engine.has_unfinished():
            done.update((out.request_id, out) for out in engine.step())
        tensors = [(h.k.cpu(), h.v.cpu(), h.routes.cpu()) for h in handoffs]
        samples = [[(s.token_ids, s.logprobs) for s in done[i].samples] for i in ids]
        conn.send_bytes(pickle.dumps(("ok", tensors, samples)))  # copies, not shared storage
    except Exception as e:  # noqa: BLE001 -- reported to the parent
        conn.send_bytes(pickle.dumps(("error", repr(e), None)))


def shared_then_decoded_elsewhere(directory: str, device: str):
    handoffs = prefill(make_engine(directory, device), PROMPTS, PARAMS)
    sender = HandoffSender(device)
    key, shared = sender.share(handoffs)
    blob = pickle.dumps(shared)  # what crosses the Ray call: handles, never the bytes
    assert len(blob) < nbytes(handoffs) / 4
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_decode_in_child, args=(directory, device, blob, child))
    proc.start()
    status, tensors, samples = pickle.loads(parent.recv_bytes())
    proc.join(timeout=120)
    assert status == "ok", tensors
    for h, (k, v, routes) in zip(handoffs, tensors, strict=True):
        assert torch.equal(h.k.cpu(), k) and torch.equal(h.v.cpu(), v)
        assert torch.equal(h.routes.cpu(), routes)
    sender.release(key)
    assert sender.held == 0
    return handoffs, shared, samples


def reference(directory: str):
    engine = make_engine(directory)
    ids = [engine.add_request(p, PARAMS) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step())
    return [[(s.token_ids, s.logprobs) for s in done[i].samples] for i in ids]


def assert_samples_equal(got, want) -> None:
    for g, w in zip(got, want, strict=True):
        for (gt, gl), (wt, wl) in zip(g, w, strict=True):
            assert gt == wt
            assert max(abs(a - b) for a, b in zip(gl, wl)) <= 1e-12


def test_cpu_handoffs_through_shared_memory_decode_as_one_engine(checkpoint):
    handoffs, shared, samples = shared_then_decoded_elsewhere(checkpoint, "cpu")
    assert all(h.k[0].kind == "shm" for h in shared)
    assert nbytes(handoffs) == sum(
        t.numel() * t.element_size() for h in handoffs for t in (h.k, h.v, h.routes)
    )
    assert_samples_equal(samples, reference(checkpoint))
    # released: the buffers are gone, as when the prefill actor dies before they are opened
    with pytest.raises(HandoffGone, match="buffer is gone"):
        HandoffReceiver("cpu").open(shared)


def test_handoffs_from_another_node_are_the_tensors_themselves(checkpoint):
    handoffs = prefill(make_engine(checkpoint), PROMPTS, PARAMS)
    opened = HandoffReceiver("cpu").open(handoffs)
    for h, o in zip(handoffs, opened, strict=True):
        assert torch.equal(h.k, o.k) and torch.equal(h.routes, o.routes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_handoffs_through_cuda_ipc_decode_as_one_engine(checkpoint):
    handoffs, shared, samples = shared_then_decoded_elsewhere(checkpoint, "cuda:0")
    assert all(h.k[0].kind == "cuda_ipc" for h in shared)
    assert_samples_equal(samples, reference(checkpoint))
