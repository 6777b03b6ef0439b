"""`EngineConfig.quantization="fp8"`: the decoder's linear weights held as block-wise FP8.

Against an independent engine: the same checkpoint with every linear weight replaced by its
dequantized FP8 form (`quantization.dequantize`, cast to the model dtype), loaded by a plain
float32 / bfloat16 engine. The FP8 engine must compute the same function: greedy tokens equal,
log-probs (the sampled token's and the top 20, prompt log-probs too) equal within float32
rounding. Dense families (QKV bias, q/k-norm with tied embeddings, several 128-blocks with
ragged edges) and both mixtures of experts (experts and a shared expert in FP8, the router not).
The engine's FP8 weights are the fresh quantization of the checkpoint's, bitwise, and survive
release / resume with an update in full precision or in FP8.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quantization import FP8_DTYPE, dequantize, is_quantized_weight, quantize, scale_name
from rollout import Engine, EngineConfig, SamplingParams
from rollout.fp8_linear import Fp8Linear

from tiny_hf import make_hf_model, save_hf_model

PROMPTS = [[3, 17, 5, 29, 11, 7, 23, 2], [13, 8, 61, 4]]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True, top_logprobs=20)
# (rtol, atol): float32 GEMMs of fused and separate projections round differently, and a dozen
# decode steps carry that forward; bfloat16 rounds both engines' outputs to the same values.
TOLERANCE = {"float32": (2e-5, 1e-5), "bfloat16": (0.0, 0.0)}
CASES = {
    "qwen2": {},  # QKV bias, untied
    "qwen3": {},  # q/k-norm, tied embeddings
    "llama_blocks": dict(  # 2 x 3 and 3 x 2 blocks of 128, ragged at the edges
        family="llama", hidden_size=320, intermediate_size=200, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2,
    ),
    "qwen3_moe": {},
    "qwen2_moe": {},  # shared expert
}  # fmt: skip


def _checkpoint(tmp_path: Path, case: str) -> Path:
    overrides = dict(CASES[case])
    family = overrides.pop("family", case)
    return save_hf_model(make_hf_model(family, **overrides), tmp_path / case)


def _dequantized_copy(model_dir: Path, out: Path, dtype: torch.dtype) -> Path:
    """The checkpoint with each linear weight replaced by dequantize(quantize(w)) in `dtype`."""
    out.mkdir()
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    for name, t in tensors.items():
        if is_quantized_weight(name):
            tensors[name] = dequantize(*quantize(t.to(dtype)), dtype)
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _engine(model_dir: Path, dtype: str, quantization: str | None = None) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(model_dir),
            dtype=dtype,
            kv_cache_tokens=256,
            page_size=4,
            quantization=quantization,
        )
    )


def _outputs(engine: Engine):
    """Per prompt: greedy tokens, their log-probs, the top-20 (token, log-prob) per step."""
    out = []
    for (sample,) in engine.generate(PROMPTS, GREEDY):
        top = sample.top_logprobs
        out.append(
            (
                sample.token_ids,
                torch.tensor(sample.logprobs, dtype=torch.float64),
                [[t for t, _ in row] for row in top],
                torch.tensor([[lp for _, lp in row] for row in top], dtype=torch.float64),
            )
        )
    return out


def _assert_same(got, want, tolerance: tuple[float, float]) -> None:
    rtol, atol = tolerance
    for (tokens, lps, top_ids, top_lps), (w_tokens, w_lps, w_top_ids, w_top_lps) in zip(
        got, want, strict=True
    ):
        assert tokens == w_tokens
        torch.testing.assert_close(lps, w_lps, rtol=rtol, atol=atol)
        torch.testing.assert_close(top_lps, w_top_lps, rtol=rtol, atol=atol)
        assert top_ids[0] == w_top_ids[0]


def _assert_holds_quantized(engine: Engine, model_dir: Path, dtype: torch.dtype) -> None:
    """Every FP8 weight and scale the engine holds is the checkpoint's, quantized here."""
    params = dict(engine.model.named_parameters())
    seen = 0
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if not is_quantized_weight(name):
            continue
        fresh = quantize(t.to(dtype))
        assert params[name].dtype == FP8_DTYPE
        assert torch.equal(params[name].view(torch.uint8), fresh.weight.view(torch.uint8)), name
        assert torch.equal(params[scale_name(name)], fresh.scale_inv), name
        seen += 1
    assert seen and seen == sum(p.dtype == FP8_DTYPE for p in params.values())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(CASES))
def test_fp8_engine_computes_as_the_dequantized_weights(tmp_path, case, dtype):
    model_dir = _checkpoint(tmp_path, case)
    torch_dtype = getattr(torch, dtype)
    reference = _engine(_dequantized_copy(model_dir, tmp_path / "deq", torch_dtype), dtype)
    want = _outputs(reference)
    engine = _engine(model_dir, dtype, "fp8")
    _assert_holds_quantized(engine, model_dir, torch_dtype)
    # embeddings, norms, router and LM head stay in the model dtype
    kept = [p for n, p in engine.model.named_parameters() if p.dtype != FP8_DTYPE]
    assert all(p.dtype in (torch_dtype, torch.float32) for p in kept)
    assert engine.model.model.embed_tokens.weight.dtype == torch_dtype
    _assert_same(_outputs(engine), want, TOLERANCE[dtype])


def test_release_resume_and_updates_in_either_form(tmp_path):
    """The colocated order (release the weights, resume, push, alloc KV) with a push of full
    precision weights (quantized by the engine) and one of FP8 weights and scales (quantized by
    the sender): the same weights, bitwise, and the same outputs."""
    model_dir = _checkpoint(tmp_path, "qwen2")
    engine = _engine(model_dir, "float32", "fp8")
    first = _outputs(engine)
    tensors = load_file(str(model_dir / "model.safetensors"))
    quantized = []
    for name, t in tensors.items():
        if is_quantized_weight(name):
            q = quantize(t)
            quantized += [(name, q.weight), (scale_name(name), q.scale_inv)]
        else:
            quantized.append((name, t))
    for stream in (tensors.items(), quantized):
        engine.release_memory(weights=True)
        engine.resume_weights()
        engine.update_weights(stream)
        engine.alloc_kv()
        _assert_holds_quantized(engine, model_dir, torch.float32)
        _assert_same(_outputs(engine), first, (0.0, 0.0))


def test_fp8_tensors_for_a_full_precision_engine_are_refused(tmp_path):
    model_dir = _checkpoint(tmp_path, "qwen2")
    engine = _engine(model_dir, "float32")
    name = "model.layers.0.mlp.up_proj.weight"
    weight = load_file(str(model_dir / "model.safetensors"))[name]
    with pytest.raises(ValueError, match="arrives in FP8, but this engine holds it in"):
        engine.update_weights([(name, quantize(weight).weight)])


def test_float64_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="quantization='fp8' rounds weights") as err:
        EngineConfig(model_path=str(tmp_path), dtype="float64", quantization="fp8")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(model_path=str(tmp_path), quantization="int4")


def _fp8_stream(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint as a sender quantizing at sync time sends it: FP8 weights and scales."""
    out = []
    for name, t in load_file(str(model_dir / "model.safetensors")).items():
        if is_quantized_weight(name):
            q = quantize(t)
            out += [(name, q.weight), (scale_name(name), q.scale_inv)]
        else:
            out.append((name, t))
    return out


def test_kept_dequantized_weights_follow_every_update(tmp_path):
    """On a CPU an FP8 layer keeps its dequantized weight between forwards. After each change
    of weights (an FP8 push, a full-precision push, a release / resume with a push) the engine
    still computes exactly as an engine holding the new weights dequantized, so the kept copy
    is never stale (within float32 rounding: the reference fuses projections; and exactly as
    a fresh FP8 engine of the new weights); the FP8 weights stay the held ones, bitwise; a
    release frees the copies."""
    a = save_hf_model(make_hf_model("qwen2", seed=0), tmp_path / "a")
    b = save_hf_model(make_hf_model("qwen2", seed=1), tmp_path / "b")
    want = {
        name: _outputs(
            _engine(_dequantized_copy(d, tmp_path / f"deq_{name}", torch.float32), "float32")
        )
        for name, d in (("a", a), ("b", b))
    }
    assert want["a"][0][0] != want["b"][0][0]  # the two checkpoints generate apart
    fresh = {name: _outputs(_engine(d, "float32", "fp8")) for name, d in (("a", a), ("b", b))}

    def check(name: str) -> None:
        _assert_same(_outputs(engine), want[name], TOLERANCE["float32"])
        _assert_same(_outputs(engine), fresh[name], (0.0, 0.0))

    engine = _engine(a, "float32", "fp8")
    layers = [m for m in engine.model.modules() if isinstance(m, Fp8Linear)]
    check("a")
    assert all(m.keeps_dequantized for m in layers)  # kept after a forward

    engine.update_weights(_fp8_stream(b))  # FP8 weights and scales from the sender
    _assert_holds_quantized(engine, b, torch.float32)
    check("b")

    engine.update_weights(load_file(str(a / "model.safetensors")).items())  # quantized here
    _assert_holds_quantized(engine, a, torch.float32)
    check("a")

    engine.release_memory(weights=True)
    assert not any(m.keeps_dequantized for m in layers)
    engine.resume_weights()
    engine.update_weights(load_file(str(b / "model.safetensors")).items())
    engine.alloc_kv()
    _assert_holds_quantized(engine, b, torch.float32)
    check("b")
