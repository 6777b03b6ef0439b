"""Block-wise FP8 (128 x 128, float32 scales) against a reference written from the formula, one
block at a time: scale = block amax / 448 (1 where that is zero), q = e4m3fn(clamp(w / scale)),
rounding by torch's float8 dtype; and against the error bound e4m3 guarantees."""

from __future__ import annotations

import pytest
import torch

from quantization import (
    FP8_DTYPE,
    dequantize,
    is_quantized_weight,
    quantize,
    scale_name,
    scale_shape,
)


def reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale) block by block, in plain loops over the blocks."""
    w = w.float()
    rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
    q = torch.empty(w.shape, dtype=FP8_DTYPE)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = block.abs().max() / 448.0
            if s == 0:
                s = torch.tensor(1.0)
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (
                (block / s).clamp(-448.0, 448.0).to(FP8_DTYPE)
            )
    return q, scale


def cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    outlier = torch.randn(256, 256, generator=g) * 0.02
    outlier[3, 5] = 1e4  # one block's scale set by a single value; its neighbours underflow
    subnormal = torch.randn(130, 140, generator=g) * 1e-39  # float32 subnormals
    tiny = torch.full((64, 64), 1e-44)  # amax / 448 underflows to 0: scale 1, zeros
    mixed = torch.randn(200, 300, generator=g)
    mixed[:128, :128] = 0.0  # one all-zero block among normal ones
    return {
        "random": torch.randn(384, 512, generator=g),
        "ragged": torch.randn(129, 257, generator=g) * 3,
        "one_element": torch.tensor([[-2.5]]),
        "thin": torch.randn(1, 300, generator=g),
        "zeros": torch.zeros(130, 130),
        "outlier": outlier,
        "subnormal": subnormal,
        "tiny": tiny,
        "mixed_zero_block": mixed,
        "bf16": torch.randn(140, 260, generator=g).to(torch.bfloat16),
        "max_values": torch.tensor([[448.0, -448.0, 1e30, -1e-30]]),
    }


@pytest.mark.parametrize("case", list(cases()))
def test_quantize_equals_the_formula_block_by_block(case):
    w = cases()[case]
    got = quantize(w)
    q, scale = reference(w)
    assert got.weight.dtype == FP8_DTYPE and got.scale_inv.dtype == torch.float32
    assert got.scale_inv.shape == scale_shape(w.shape) == scale.shape
    assert torch.equal(got.scale_inv, scale)
    assert torch.equal(got.weight.view(torch.uint8), q.view(torch.uint8))  # bitwise, -0 too
    # dequantize is q * scale in float32
    expected = (
        q.float()
        * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
    )
    assert torch.equal(dequantize(got.weight, got.scale_inv), expected)
    assert torch.equal(
        dequantize(got.weight, got.scale_inv, torch.bfloat16), expected.to(torch.bfloat16)
    )


@pytest.mark.parametrize("case", ["random", "ragged", "outlier", "mixed_zero_block", "bf16"])
def test_error_within_what_e4m3_guarantees(case):
    """Normal e4m3 values carry 3 mantissa bits: relative error at most 2^-4; below the smallest
    normal (2^-6 of the scale) the spacing is 2^-9, an absolute error of 2^-10 scale."""
    w = cases()[case].float()
    got = quantize(w)
    scale = dequantize(torch.ones(w.shape, dtype=FP8_DTYPE), got.scale_inv)
    err = (dequantize(got.weight, got.scale_inv) - w).abs()
    bound = torch.maximum(w.abs() * 2**-4, scale * 2**-10) * (1 + 1e-6)
    assert (err <= bound).all()
    # each block's largest value maps to +-448 exactly: the whole e4m3 range is used
    assert got.weight.float().abs().amax() == 448.0


def test_zeros_stay_zero_with_unit_scales():
    got = quantize(torch.zeros(130, 5))
    assert torch.equal(got.scale_inv, torch.ones(2, 1))
    assert not got.weight.float().any()


def test_wrong_inputs_are_refused_in_one_line():
    with pytest.raises(ValueError, match="2-D weights"):
        quantize(torch.zeros(4))
    with pytest.raises(ValueError, match="not float64"):
        quantize(torch.zeros(4, 4, dtype=torch.float64))


def test_linear_weights_are_named_by_their_role():
    quantized = [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.2.mlp.down_proj.weight",
        "model.layers.2.mlp.experts.7.gate_proj.weight",
        "model.layers.2.mlp.shared_expert.up_proj.weight",
    ]
    kept = [
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_norm.weight",
        "model.layers.2.mlp.gate.weight",  # the router
        "model.layers.2.mlp.shared_expert_gate.weight",
    ]
    assert all(is_quantized_weight(n) for n in quantized)
    assert not any(is_quantized_weight(n) for n in kept)
    assert scale_name(quantized[0]) == "model.layers.0.self_attn.q_proj.weight_scale_inv"
