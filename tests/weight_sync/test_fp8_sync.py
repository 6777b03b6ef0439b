"""Quantization at sync time (`ColocatedSender(quantization="fp8")`): the sender's buckets carry
each linear weight as FP8 + float32 block scales, the engine copies them as they are, and what it
holds equals a fresh quantization of the sender's weights bitwise; the checksums cover those FP8
bytes (a flipped one is caught); the linear layers cost at most 0.55x their bf16 bytes."""

from __future__ import annotations

import pytest
import torch

from quantization import FP8_DTYPE, is_quantized_weight, quantize, scale_name
from rollout import Engine, EngineConfig
from rollout.weights import iter_safetensors
from weight_sync import BucketReceiver, ColocatedSender, Done, WeightSyncError
from weight_sync.quantize import quantized_stream

from tiny_hf import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """(old, new) in bf16, the engine's dtype: the engine starts from old, the sender holds new
    (several 128-blocks per weight, ragged edges)."""
    dims = dict(hidden_size=192, intermediate_size=320, num_attention_heads=4, head_dim=48)
    return [
        save_hf_model(
            make_hf_model("qwen2", seed=seed, dtype=torch.bfloat16, **dims),
            tmp_path_factory.mktemp(f"ckpt{seed}"),
        )
        for seed in (0, 1)
    ]


def _engine(path) -> Engine:
    return Engine(
        EngineConfig(model_path=str(path), dtype="bfloat16", kv_cache_tokens=64, quantization="fp8")
    )


def test_engine_holds_the_senders_quantization_bitwise(two_checkpoints):
    old, new = two_checkpoints
    engine = _engine(old)
    receiver = BucketReceiver(engine)
    manifests = []

    def deliver(handle, manifest):
        manifests.append(manifest)
        return Done(receiver.load(handle, manifest))

    sender = ColocatedSender(deliver, bucket_bytes=64 << 10, quantization="fp8")
    new_weights = dict(iter_safetensors(new))
    report = sender.send(new_weights.items())
    receiver.commit()
    sender.close()
    params = dict(engine.model.named_parameters())
    linear = [n for n in new_weights if is_quantized_weight(n)]
    assert report.num_tensors == len(new_weights) + len(linear) == len(params)
    for name, tensor in new_weights.items():
        if name in linear:
            fresh = quantize(tensor)
            assert params[name].view(torch.uint8).equal(fresh.weight.view(torch.uint8)), name
            assert params[scale_name(name)].equal(fresh.scale_inv), name
        else:
            assert params[name].equal(tensor), name  # embeddings, norms, biases, LM head
    # what travelled: FP8 and float32 scale buckets for the linear layers
    sent = {e.name: e.numel * torch.empty((), dtype=m.dtype).element_size() for m in manifests
            for e in m.entries}  # fmt: skip
    assert {m.dtype for m in manifests} == {torch.bfloat16, FP8_DTYPE, torch.float32}
    fp8_bytes = sum(sent[n] + sent[scale_name(n)] for n in linear)
    bf16_bytes = sum(new_weights[n].numel() * 2 for n in linear)
    assert fp8_bytes <= 0.55 * bf16_bytes
    assert report.nbytes == sum(sent.values())


def test_a_flipped_fp8_byte_is_caught(two_checkpoints):
    old, new = two_checkpoints
    engine = _engine(old)
    receiver = BucketReceiver(engine)

    def corrupting_deliver(handle, manifest):
        if manifest.dtype == FP8_DTYPE:
            buffer = receiver.opener.open(handle)
            buffer.view(torch.uint8)[manifest.entries[-1].offset + 7] ^= 0x01
        return Done(receiver.load(handle, manifest))

    sender = ColocatedSender(corrupting_deliver, bucket_bytes=64 << 10, quantization="fp8")
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        sender.send(iter_safetensors(new))
    sender.close()


def test_the_stream_passes_other_tensors_and_refuses_unknown_formats():
    w = torch.randn(130, 70)
    bias = torch.randn(130)
    stream = [("model.layers.0.mlp.up_proj.weight", w), ("model.layers.0.mlp.up_proj.bias", bias)]
    assert list(quantized_stream(stream, None)) == stream
    (name, q), (sname, s), (bname, b) = quantized_stream(stream, "fp8")
    assert (name, sname, bname) == (stream[0][0], scale_name(stream[0][0]), stream[1][0])
    assert q.dtype == FP8_DTYPE and s.shape == (2, 1) and b is bias
    with pytest.raises(ValueError, match="quantization='int8' is not one of"):
        list(quantized_stream(stream, "int8"))
