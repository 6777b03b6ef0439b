"""Write a random-init Hugging Face checkpoint (config.json + model.safetensors) for a config.

For demos, benchmarks and tiny built-in models: nothing is downloaded, and the files are exactly
what a real checkpoint directory holds, so they load through the same path as real weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from model_spec import ModelSpec
from rollout.model import CausalLM

# A Qwen2.5-style layout shrunk to run anywhere.
TINY_QWEN2: dict[str, Any] = dict(
    architectures=["Qwen2ForCausalLM"],
    model_type="qwen2",
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=4096,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    hidden_act="silu",
    eos_token_id=0,
    torch_dtype="float32",
)

# Qwen2.5-0.5B's shape (24 layers, 14 query / 2 KV heads of 64, vocab 151 936, tied): GPU
# benchmarks.
QWEN25_05B: dict[str, Any] = {
    **TINY_QWEN2,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}


def write_random_checkpoint(
    directory: str | Path,
    hf_config: dict[str, Any],
    seed: int = 0,
    std: float = 0.02,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Draw weights N(0, std) (norm weights 1) with HF names and save them with the config."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = ModelSpec.from_hf(hf_config)
    with torch.device("meta"):
        names = {n: tuple(p.shape) for n, p in CausalLM(cfg, max_positions=1).named_parameters()}
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in names.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith(".bias"):
            tensors[name] = torch.zeros(shape, dtype=dtype)
        else:
            tensors[name] = (torch.randn(shape, generator=g) * std).to(dtype)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf_config, indent=2))
    return directory
