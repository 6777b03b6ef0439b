"""Random-init checkpoints the sections share, written once per run into the work folder.

Shapes: `tiny` (the engine's tests' Qwen2 layout, head_dim 64) for the dry run; `hd128` (head_dim
128, GQA 4:1, 8 layers, 32k vocab: the Qwen2.5-7B head layout at a size that builds in seconds);
`qwen0.5b` (Qwen2.5-0.5B's shape: 24 layers, 14 / 2 heads of 64, 151 936 vocab, tied) for the
bf16 comparisons and the speed figures. `std` sets how peaked the model's distributions are
(0.02: near uniform, as an untrained model; 1.0: a few tokens take most of the mass, as a trained
policy), which decides whether speculation's drafts are accepted and how close argmax ties are.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from rollout.random_checkpoint import QWEN25_05B, TINY_QWEN2, write_random_checkpoint
from rollout.weights import iter_safetensors

HD128 = {
    **TINY_QWEN2,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
PRESETS = {"tiny": TINY_QWEN2, "hd128": HD128, "qwen0.5b": QWEN25_05B}


def checkpoint(
    workdir: Path, preset: str, *, std: float = 0.02, dtype: str = "float32", seed: int = 0
) -> str:
    """The directory of a random checkpoint (config.json + model.safetensors), written on first
    use and shared by every later section of the run."""
    directory = workdir / "models" / f"{preset}-std{std}-{dtype}-seed{seed}"
    if not (directory / "config.json").exists():
        staging = directory.with_name(directory.name + f".tmp{os.getpid()}")
        write_random_checkpoint(
            staging,
            {**PRESETS[preset], "torch_dtype": dtype},
            seed=seed,
            std=std,
            dtype=getattr(torch, dtype),
        )
        staging.rename(directory)
    return str(directory)


def layer_skip_draft(target_dir: str, num_layers: int) -> str:
    """The target's first `num_layers` layers with its embeddings, final norm and LM head: the
    one draft model a random target agrees with at all (layer-skip self-speculation)."""
    from safetensors.torch import save_file

    directory = Path(target_dir + f"-draft{num_layers}")
    if not (directory / "config.json").exists():
        config = json.loads((Path(target_dir) / "config.json").read_text())
        tensors = {
            name: t
            for name, t in iter_safetensors(target_dir)
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
        }
        staging = directory.with_name(directory.name + f".tmp{os.getpid()}")
        staging.mkdir(parents=True)
        save_file(tensors, str(staging / "model.safetensors"))
        draft_config = {**config, "num_hidden_layers": num_layers}
        (staging / "config.json").write_text(json.dumps(draft_config))
        staging.rename(directory)
    return str(directory)


def save_weights(directory: str, config_from: str, named_tensors: dict[str, torch.Tensor]) -> str:
    """A checkpoint directory holding `named_tensors` (host copies) with `config_from`'s
    config.json: what a fresh engine loads to compare with an engine updated in memory."""
    from safetensors.torch import save_file

    path = Path(directory)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    save_file(
        {n: t.detach().to("cpu").contiguous() for n, t in named_tensors.items()},
        str(path / "model.safetensors"),
    )
    shutil.copy(Path(config_from) / "config.json", path / "config.json")
    return str(path)


def random_prompts(vocab: int, count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of random ids in [1, vocab), lengths in [low, high)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
