"""quantization: low-precision number formats the trainer-side weight sync and the engine share.

A leaf package (it imports nothing of ours), so that the sender quantizing at sync time
(`weight_sync`) and the engine quantizing a checkpoint it loads (`rollout`) run the same function
and agree bitwise.
"""

from quantization.fp8 import (
    BLOCK,
    FP8_DTYPE,
    FP8_MAX,
    SCALE_SUFFIX,
    QuantizedWeight,
    dequantize,
    is_quantized_weight,
    quantize,
    scale_name,
    scale_shape,
)

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_SUFFIX",
    "QuantizedWeight",
    "dequantize",
    "is_quantized_weight",
    "quantize",
    "scale_name",
    "scale_shape",
]
