"""Colocated routing by (node, GPU UUID): the handle names its GPU, the opener refuses a GPU it
does not see and maps the one it does on its own index, and pairing only joins equal identities.

On a CPU the GPU lookup is a parameter of the opener (what `torch.cuda` would report); the
CUDA-only test at the end checks the real lookup and a real handle.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp

import pytest
import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from weight_sync import (
    BucketPacker,
    BucketReceiver,
    DeviceIdentity,
    WeightSyncError,
    device_identity,
    pair_colocated,
)
from weight_sync.identity import device_uuid, visible_gpus
from weight_sync.shared_buffers import BufferHandle, BufferOpener, SharedBufferAllocator

SENDER_INDEX = 0


def _recording_rebuild(calls):
    def rebuild(*args):
        calls.append(args)
        return torch.zeros(4)

    return rebuild


def _cuda_handle(calls, uuid: str) -> BufferHandle:
    """A handle laid out as torch's `reduce_tensor` lays out a CUDA tensor's (the device index is
    the sender's), with a rebuild function that records what it is asked to map."""
    args = tuple(f"arg{i}" for i in range(15))
    args = (*args[:6], SENDER_INDEX, *args[7:])
    return BufferHandle("cuda_ipc", (_recording_rebuild(calls), args), uuid)


def test_the_rebuild_argument_rewritten_is_torchs_storage_device():
    names = list(inspect.signature(rebuild_cuda_tensor).parameters)
    assert names[6] == "storage_device" and len(names) == 15


def test_opener_refuses_a_handle_for_a_gpu_this_process_does_not_see():
    calls = []
    opener = BufferOpener(gpus=lambda: {"GPU-1111": 0})
    with pytest.raises(WeightSyncError, match="GPU-2222.*does not see.*GPU-1111.*pair_colocated"):
        opener.open(_cuda_handle(calls, "GPU-2222"))
    assert calls == []  # nothing was mapped


def test_opener_refuses_every_cuda_handle_without_gpus():
    with pytest.raises(WeightSyncError, match="no GPU"):
        BufferOpener(gpus=dict).open(_cuda_handle([], "GPU-2222"))


def test_opener_maps_the_handle_on_this_process_index_of_its_gpu():
    """The sender's index 0 is this process's index 2 for the same GPU (other
    CUDA_VISIBLE_DEVICES): the rebuild gets 2, every other argument as sent."""
    calls = []
    opener = BufferOpener(gpus=lambda: {"GPU-1111": 0, "GPU-3333": 1, "GPU-2222": 2})
    handle = _cuda_handle(calls, "GPU-2222")
    opener.open(handle)
    ((args,),) = [calls]
    sent = handle.payload[1]
    assert args[6] == 2
    assert args[:6] == sent[:6] and args[7:] == sent[7:]


def test_a_receiver_refuses_a_foreign_gpu_handle_before_loading():
    loaded = []

    class Sink:
        def load_weights(self, named_tensors):
            loaded.extend(named_tensors)

        def commit_weights(self):
            pass

    receiver = BucketReceiver(Sink(), opener=BufferOpener(gpus=lambda: {"GPU-1111": 0}))
    _, manifest = next(BucketPacker(1 << 10).pack([("w", torch.ones(4))]))
    with pytest.raises(WeightSyncError, match="GPU-2222"):
        receiver.load(_cuda_handle([], "GPU-2222"), manifest)
    assert loaded == []


def test_shared_memory_handles_name_host_memory():
    allocator = SharedBufferAllocator("cpu")
    buffer = allocator(16, torch.float32)
    handle = allocator.handle(buffer)
    assert handle.kind == "shm" and handle.device == "cpu" == device_uuid("cpu")
    del buffer
    allocator.release()


def test_identity_on_cpu_is_the_node_and_cpu():
    assert device_identity("node-a", "cpu") == DeviceIdentity("node-a", "cpu")
    if not torch.cuda.is_available():
        assert visible_gpus() == {}


# -- pairing ---------------------------------------------------------------------------------


def _gpu(node: str, k: int) -> DeviceIdentity:
    return DeviceIdentity(node, f"GPU-{node}-{k}")


def test_pairing_feeds_each_engine_from_the_trainer_rank_on_its_gpu():
    """Two nodes of four GPUs; trainer rank r on GPU r % 4 of node r // 4, engines listed in
    another order: each engine gets exactly the rank on its GPU."""
    trainers = {r: _gpu("n0" if r < 4 else "n1", r % 4) for r in range(8)}
    engines = {f"engine{e}": _gpu("n1" if e < 4 else "n0", e % 4) for e in range(8)}
    routes = pair_colocated(trainers, engines)
    # engine e sits on node n1 for e < 4, so the rank on GPU g of node n0 feeds engine g + 4
    assert routes == {r: (f"engine{(r + 4) % 8}",) for r in range(8)}


def test_pairing_refuses_an_engine_on_a_gpu_without_a_sender():
    """The defect it guards: one source per node, handing its GPU's buffer to every engine on
    the node. Engine 1 sits on GPU 1, which no sender is on."""
    senders = {"source": _gpu("n0", 0)}
    engines = {0: _gpu("n0", 0), 1: _gpu("n0", 1)}
    with pytest.raises(ValueError, match="receiver 1 is on GPU GPU-n0-1 of node n0"):
        pair_colocated(senders, engines)


def test_pairing_refuses_the_same_gpu_uuid_on_another_node():
    with pytest.raises(ValueError, match="node n1"):
        pair_colocated({0: DeviceIdentity("n0", "GPU-x")}, {0: DeviceIdentity("n1", "GPU-x")})


def test_pairing_on_cpu_sends_a_node_through_its_first_listed_sender():
    senders = {
        2: DeviceIdentity("n0", "cpu"),
        0: DeviceIdentity("n0", "cpu"),
        5: DeviceIdentity("n1", "cpu"),
    }
    engines = {e: DeviceIdentity("n0" if e % 2 == 0 else "n1", "cpu") for e in range(5)}
    assert pair_colocated(senders, engines) == {2: (0, 2, 4), 0: (), 5: (1, 3)}
    with pytest.raises(ValueError, match="host memory of node n1"):
        pair_colocated({0: DeviceIdentity("n0", "cpu")}, {0: DeviceIdentity("n1", "cpu")})


def test_pairing_cpu_and_gpu_identities_never_match():
    with pytest.raises(ValueError, match="no sender"):
        pair_colocated({0: DeviceIdentity("n0", "cpu")}, {0: _gpu("n0", 0)})


# -- on a GPU --------------------------------------------------------------------------------


def _open_in_child(handle, conn):
    try:
        buffer = BufferOpener().open(handle)
        conn.send(("ok", buffer.cpu().clone(), device_uuid(buffer.device)))
    except Exception as e:  # noqa: BLE001 -- reported to the parent
        conn.send(("error", repr(e), None))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_handle_carries_the_gpu_uuid_and_opens_in_another_process():
    allocator = SharedBufferAllocator("cuda:0")
    buffer = allocator(1024, torch.bfloat16)
    buffer.copy_(torch.arange(1024, dtype=torch.bfloat16, device="cuda:0"))
    torch.cuda.synchronize()
    handle = allocator.handle(buffer)
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    assert handle.kind == "cuda_ipc" and handle.device == uuid
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_open_in_child, args=(handle, child))
    proc.start()
    status, data, seen = parent.recv()
    proc.join(timeout=60)
    assert status == "ok", data
    assert seen == uuid and torch.equal(data, buffer.cpu())
    del buffer
    allocator.release()
