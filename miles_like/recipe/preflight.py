"""Checks of a recipe against this machine, before Ray starts (and in `--dry-run`): the files it
names hold what the run will read, the output directory can be one, the draft model shares the
model's vocabulary, and the devices it asks for exist here. Each failure is one RecipeError line
naming the field or file and the fix; `--no-path-check` skips them all (a recipe meant for
another machine)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from miles_like.errors import RecipeError


def check_model_weights(field: str, path: str, *, sharded_names: tuple[str, ...]) -> None:
    """`path` (which has a config.json) also has weights in one of `sharded_names`' forms."""
    p = Path(path).expanduser()
    if any(next(p.glob(name), None) for name in sharded_names):
        return
    pickles = sorted(x.name for x in p.glob("*.bin"))
    hint = (
        (
            f"; {pickles[0]} is a PyTorch pickle, which is not read: save the model with "
            "save_pretrained(..., safe_serialization=True)"
        )
        if pickles
        else ""
    )
    raise RecipeError(
        f"{field}={path!r} has config.json but no weights "
        f"({' or '.join(sharded_names)}){hint}; point it at a complete Hugging Face "
        "model directory"
    )


def read_config(field: str, path: str) -> dict[str, Any]:
    file = Path(path).expanduser() / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecipeError(
            f"{field}={path!r}: cannot read {file.name} ({type(e).__name__}: {e}); "
            "fix or replace the file"
        ) from None
    if not isinstance(config, dict):
        raise RecipeError(f"{field}={path!r}: {file.name} is not a JSON object; fix or replace it")
    return config


def check_output_dir(path: str) -> None:
    """`tracking.output_dir` is a directory or can be created as one (no file on its way)."""
    p = Path(path).expanduser()
    for part in (p, *p.parents):
        if part.exists():
            if not part.is_dir():
                what = "is a file" if part == p else f"runs through the file {str(part)!r}"
                raise RecipeError(
                    f"tracking.output_dir={path!r} {what}, not a directory; give "
                    "a directory (it is created if missing)"
                )
            return


def check_draft_vocab(recipe) -> None:
    """The draft model samples token ids the target verifies: one vocabulary for both."""
    draft = recipe.rollout.speculative_draft_model_path
    if draft is None:
        return
    draft_vocab = read_config("rollout.speculative_draft_model_path", draft).get("vocab_size")
    if recipe.model.path is not None:
        target_vocab = read_config("model.path", recipe.model.path).get("vocab_size")
        target = f"model.path {recipe.model.path!r}'s"
    else:
        from miles_like.models.tokenizer import builtin_tokenizer  # the built-ins' vocabulary

        target_vocab = builtin_tokenizer().vocab_size
        target = f"model.builtin={recipe.model.builtin}'s"
    if draft_vocab is not None and target_vocab is not None and draft_vocab != target_vocab:
        raise RecipeError(
            f"rollout.speculative_draft_model_path={draft!r}: its vocab_size "
            f"{draft_vocab} differs from {target} {target_vocab}; a draft model "
            "must share the model's tokenizer"
        )


def model_config(recipe) -> dict[str, Any]:
    """The policy's `config.json`: the user's, or the built-in's."""
    if recipe.model.path is not None:
        return read_config("model.path", recipe.model.path)
    from miles_like.models.builtin import hf_config
    from miles_like.models.tokenizer import builtin_tokenizer

    return hf_config(recipe.model.builtin, builtin_tokenizer())


def check_engine_tp(recipe) -> None:
    """`rollout.tp` splits attention heads, KV heads and the MLP evenly across the ranks."""
    k = recipe.rollout.tp
    if k == 1:
        return
    config = model_config(recipe)
    heads = config.get("num_attention_heads")
    for key, value in (
        ("num_attention_heads", heads),
        ("num_key_value_heads", config.get("num_key_value_heads", heads)),
        ("intermediate_size", config.get("intermediate_size")),
    ):
        if value is not None and value % k:
            raise RecipeError(
                f"rollout.tp={k} must divide the model's {key}={value}; choose a divisor of it"
            )


def replays_routes(recipe, config: dict[str, Any]) -> bool:
    """Whether the run replays the engine's expert routes in the trainer
    (`algorithm.routing_replay`; null: a mixture of experts does, on either backend), for the
    model's `config`."""
    from model_spec import MOE_MODEL_TYPES

    moe = config.get("model_type") in MOE_MODEL_TYPES
    choice = recipe.algorithm.routing_replay
    if choice == "rollout" and not moe:
        raise RecipeError(
            f"algorithm.routing_replay=rollout: the model ({config.get('model_type')!r}) is not "
            "a mixture of experts, it has no routes; set algorithm.routing_replay: off"
        )
    if choice is None:
        return moe
    return choice == "rollout"


def check_trainer_layout(recipe) -> None:
    """The megatron backend's `trainer.tp` splits heads, KV heads, the MLP and a mixture's
    experts evenly, and a mixture of experts trains at trainer PP 1 for now (its all-gather
    token dispatcher takes fixed shapes, which pipeline stages exchanging packed micro-batches
    of varying length do not give it)."""
    t = recipe.trainer
    if t.backend != "megatron" or (t.tp == 1 and t.pp == 1):
        return
    from model_spec import MOE_MODEL_TYPES

    config = model_config(recipe)
    moe = config.get("model_type") in MOE_MODEL_TYPES
    if moe and t.pp > 1:
        raise RecipeError(
            f"trainer.pp={t.pp} with the mixture of experts {config.get('model_type')!r} is not "
            "supported yet; set trainer.pp=1 (trainer.tp and rollout.tp do shard the experts)"
        )
    heads = config.get("num_attention_heads")
    sizes = [
        ("num_attention_heads", heads),
        ("num_key_value_heads", config.get("num_key_value_heads", heads)),
        ("intermediate_size", config.get("intermediate_size")),
    ]
    if moe:
        sizes += [
            ("moe_intermediate_size", config.get("moe_intermediate_size")),
            ("shared_expert_intermediate_size", config.get("shared_expert_intermediate_size")),
        ]
    for key, value in sizes:
        if value and value % t.tp:
            raise RecipeError(
                f"trainer.tp={t.tp} must divide the model's {key}={value}; choose a divisor of it"
            )


def check_accelerator(cluster) -> None:
    """`cuda` on a local cluster needs CUDA here (a remote cluster's nodes are not visible)."""
    if cluster.accelerator != "cuda" or cluster.address is not None:
        return
    import torch  # only for this check: --dry-run stays light otherwise

    if not torch.cuda.is_available():
        raise RecipeError(
            "cluster.accelerator=cuda: this machine has no usable CUDA device "
            "(torch.cuda.is_available() is False); use auto or cpu, or set "
            "cluster.address to a Ray cluster with GPUs"
        )


def check_machine(recipe) -> None:
    """Every check above that applies to `recipe` (its paths are known to exist)."""
    if recipe.model.path is not None:
        check_model_weights(
            "model.path",
            recipe.model.path,
            sharded_names=("model.safetensors", "model.safetensors.index.json"),
        )
    draft = recipe.rollout.speculative_draft_model_path
    if draft is not None:
        check_model_weights(
            "rollout.speculative_draft_model_path", draft, sharded_names=("*.safetensors",)
        )
    check_draft_vocab(recipe)
    check_engine_tp(recipe)
    check_trainer_layout(recipe)
    replays_routes(recipe, model_config(recipe))
    check_output_dir(recipe.tracking.output_dir)
    check_accelerator(recipe.cluster)
    if recipe.data.path is not None:
        from miles_like.data import read_table  # HF datasets: only for a data file

        read_table(recipe.data)
