"""FP8 under engine tensor parallelism: the 128-wide blocks never straddle two ranks' shards.

The choice: a sharded dimension's share must be a multiple of 128 (one clear error otherwise),
so a weight the sender quantizes whole is exactly the ranks' own quantized shards side by side.
Two real gloo ranks each build their shard of an FP8 model and load it twice, from the
full-precision checkpoint (each rank quantizes its own slice) and from the sender's whole-tensor
FP8 weights and scales (each rank narrows them); both must equal the parent's quantization of
the full tensor narrowed to the rank's shard, bitwise, and so must the FP8 tensors rank 0 relays to
the other rank as a TP command (gloo broadcasts no float8: they travel as bytes). A model whose
shards would be 32 wide is refused at build time. The ranks meet through a file (`two_ranks`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from two_ranks import join_world, run_two_ranks

from model_spec import ModelSpec
from quantization import FP8_DTYPE, is_quantized_weight, quantize, scale_name
from rollout.model import CausalLM
from rollout.parallel_layers import shard_spec
from rollout.tp_group import LoadWeights, TPGroup
from rollout.weights import load_weights

from tiny_hf import make_hf_model, save_hf_model

ALIGNED = dict(  # q/k/v/o, gate/up/down shards all 128 wide over 2 ranks
    hidden_size=256, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
    head_dim=64, num_hidden_layers=1,
)  # fmt: skip


def _sender_stream(tensors: dict[str, torch.Tensor]):
    for name, t in tensors.items():
        if is_quantized_weight(name):
            q = quantize(t)
            yield name, q.weight
            yield scale_name(name), q.scale_inv
        else:
            yield name, t


def _fp8_state(model) -> dict[str, torch.Tensor]:
    fp8 = {n for n, p in model.named_parameters() if p.dtype == FP8_DTYPE}
    return {
        n: p.detach().clone()
        for n, p in model.named_parameters()
        if n in fp8 or n.removesuffix("_scale_inv") in fp8
    }


DEADLINE_S = 300


def _rank(rank: int, rendezvous: str, model_dir: str, out_dir: str) -> None:
    join_world(rank, rendezvous)
    out = Path(out_dir) / f"rank{rank}.pt"
    try:
        spec = ModelSpec.from_dir(model_dir)
        try:
            model = CausalLM.build(spec, 64, torch.float32, torch.device("cpu"), TPGroup(), "fp8")
        except ValueError as e:
            torch.save({"error": str(e)}, out)
            return
        shards = shard_spec(model)
        tensors = load_file(str(Path(model_dir) / "model.safetensors"))
        kwargs = dict(tied_embeddings=spec.tie_word_embeddings, require_all=True, shards=shards)
        load_weights(model, tensors.items(), **kwargs)
        own = _fp8_state(model)
        load_weights(model, _sender_stream(tensors), **kwargs)
        sent = _fp8_state(model)
        # how rank 0 hands the sender's tensors to the other ranks (`Engine.load_weights`)
        tp = TPGroup()
        if rank == 0:
            tp.send(LoadWeights(list(_sender_stream(tensors))))
        else:
            load_weights(model, tp.receive(torch.device("cpu")).named_tensors, **kwargs)
        relayed = _fp8_state(model)
        torch.save({"own": own, "sent": sent, "relayed": relayed, "shards": shards}, out)
    finally:
        dist.destroy_process_group()


def _spawn(model_dir: Path, tmp_path: Path) -> list[dict]:
    out_dir = tmp_path / "ranks"
    out_dir.mkdir()
    run_two_ranks(_rank, (str(model_dir), str(out_dir)), out_dir, DEADLINE_S)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_blocks_stay_within_shards(tmp_path):
    model_dir = save_hf_model(make_hf_model("llama", **ALIGNED), tmp_path / "aligned")
    tensors = load_file(str(model_dir / "model.safetensors"))
    results = _spawn(model_dir, tmp_path)
    for result in results:
        own, sent, shards = result["own"], result["sent"], result["shards"]
        relayed = result["relayed"]
        names = [n for n in tensors if is_quantized_weight(n)]
        assert names and {*names, *map(scale_name, names)} == own.keys() == sent.keys()
        for name in names:
            whole = quantize(tensors[name])
            want = {name: whole.weight, scale_name(name): whole.scale_inv}
            for key, full in want.items():
                expected = shards[key].take(full)
                assert own[key].shape == expected.shape < full.shape, key
                for got in (own[key], sent[key], relayed[key]):
                    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), key


def test_shards_narrower_than_a_block_are_refused(tmp_path):
    model_dir = save_hf_model(make_hf_model("llama"), tmp_path / "narrow")
    for result in _spawn(model_dir, tmp_path):
        error = result["error"]
        assert "quantization='fp8' with tp=2" in error and "must not straddle shards" in error
        assert "\n" not in error
