"""Model directories the run starts from: the user's local Hugging Face directory, or a built-in
tiny model materialized on disk (config.json + model.safetensors + tokenizer.json +
tokenizer_config.json), so that trainer, engines and `AutoTokenizer` load it through the same path
as a real checkpoint.

Built-in models and warm starts are cached under `$MILES_LIKE_CACHE` (default
`~/.cache/miles_like`), keyed by a hash of everything that determines their contents. A cache
entry is written to a temporary directory and renamed into place, so a directory that exists is
complete (a run killed while writing leaves only a `.tmp-*` directory behind).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_like.models.builtin import hf_config
from miles_like.models.tokenizer import builtin_tokenizer, save_char_tokenizer
from rollout.random_checkpoint import write_random_checkpoint

INIT_STD = 0.02  # HF's initializer_range for Qwen2 / Llama


def cache_root() -> Path:
    return Path(os.environ.get("MILES_LIKE_CACHE", Path.home() / ".cache" / "miles_like"))


def content_key(*parts: Any) -> str:
    """A short stable hash of JSON-able parts."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cached_dir(name: str, build: Callable[[Path], None]) -> Path:
    """`cache_root()/name`, built by `build(tmp_dir)` unless it already exists."""
    final = cache_root() / name
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=final.parent))
    try:
        build(tmp)
        try:
            tmp.rename(final)
        except OSError:  # another run finished the same entry first; theirs is equal
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def base_model_dir(model_section, seed: int) -> Path:
    """The directory the run's policy starts from (before any warm start)."""
    if model_section.path is not None:
        return Path(model_section.path).expanduser()
    tokenizer = builtin_tokenizer()
    config = hf_config(model_section.builtin, tokenizer)

    def build(tmp: Path) -> None:
        write_random_checkpoint(tmp, config, seed=seed, std=INIT_STD)
        save_char_tokenizer(tmp)

    # The tokenizer's full serialization (vocabulary, added tokens, chat template) is part of
    # the key: a model built for another tokenizer is never reused.
    key = content_key(
        config,
        seed,
        INIT_STD,
        tokenizer.tok.backend_tokenizer.to_str(),
        tokenizer.tok.chat_template,
    )
    return cached_dir(f"builtin-{model_section.builtin}-{key}", build)


def _is_model_file(f: Path) -> bool:
    return (
        f.is_file()
        and not f.name.endswith((".safetensors", ".bin", ".pt", ".pth"))
        and f.name != "model.safetensors.index.json"
    )


def copy_model_files(src: Path, dst: Path) -> None:
    """Everything of a model directory except its weights (config, tokenizer files)."""
    for f in src.iterdir():
        if _is_model_file(f):
            shutil.copy2(f, dst / f.name)


def read_model_files(src: Path, skip: frozenset[str] = frozenset()) -> dict[str, bytes]:
    """What `copy_model_files` copies (less the names in `skip`), read into memory."""
    return {
        f.name: f.read_bytes() for f in src.iterdir() if _is_model_file(f) and f.name not in skip
    }


def write_model_files(files: dict[str, bytes], dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (dst / name).write_bytes(data)
