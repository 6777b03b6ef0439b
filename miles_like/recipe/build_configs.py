"""The recipe mapped onto the configs of the packages it drives: `trainer.TrainerConfig` (policy
and critic), `rollout.EngineConfig` and `rollout.SamplingParams`.

Those configs validate themselves; we do not repeat their checks. A `ValueError` they raise is
re-raised as a `RecipeError` with their field names rewritten to the recipe's (e.g.
`trainer.loss.kl_kind` -> `algorithm.kl_type`), so the user sees the field they wrote.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from miles_like.recipe.schema import RecipeError
from miles_like.recipe.sections import Recipe, device_type
from rollout.config import EngineConfig, SamplingParams
from trainer.config import LossConfig, OptimConfig, TrainerConfig

# config field (as the configs' own messages name it) -> recipe field
FIELD_NAMES: dict[str, str] = {
    "trainer.optim.lr_schedule": "trainer.lr_schedule",
    "trainer.optim.warmup_steps": "trainer.warmup_steps",
    "trainer.optim.total_steps": "steps",
    "trainer.loss.policy_loss": "algorithm.gspo",
    "trainer.loss.agg_mode": "algorithm.loss_agg",
    "trainer.loss.kl_kind": "algorithm.kl_type",
    "trainer.loss.kl_coef": "algorithm.kl_coef",
    "trainer.loss.is_correction": "algorithm.is_correction",
    "trainer.loss.temperature": "rollout.temperature",
    "trainer.backend": "trainer.backend",
    "trainer.dtype": "model.dtype",
    "trainer.max_tokens_per_micro_batch": "trainer.max_tokens_per_micro_batch",
    "SamplingParams.n": "rollout.n",
    "SamplingParams.temperature": "rollout.temperature",
    "SamplingParams.top_p": "rollout.top_p",
    "SamplingParams.top_k": "rollout.top_k",
    "SamplingParams.max_new_tokens": "rollout.max_new_tokens",
    "EngineConfig.dtype": "model.dtype",
    "EngineConfig.kv_cache_tokens": "rollout.kv_cache_tokens",
    "EngineConfig.page_size": "rollout.page_size",
    "EngineConfig.max_running_requests": "rollout.max_running_requests",
    "EngineConfig.speculative_method": "rollout.speculative_method",
    "EngineConfig.num_speculative_tokens": "rollout.num_speculative_tokens",
    "EngineConfig.speculative_draft_model_path": "rollout.speculative_draft_model_path",
    "EngineConfig.attention_backend": "rollout.attention_backend",
    "EngineConfig.decode_graphs": "rollout.decode_graphs",
    "EngineConfig.compile": "rollout.compile",
    "EngineConfig.tensor_parallel_size": "rollout.tp",
}
_FIELD_RE = re.compile(
    "|".join(re.escape(k) + r"(?![A-Za-z0-9_])" for k in sorted(FIELD_NAMES, key=len, reverse=True))
)

T = TypeVar("T")


def recipe_message(message: str) -> str:
    """A config's error message with its field names replaced by the recipe's."""
    return _FIELD_RE.sub(lambda m: FIELD_NAMES[m.group()], message)


def _build(make: Callable[[], T], section: str) -> T:
    try:
        return make()
    except ValueError as e:
        text = recipe_message(str(e))
        if not _names_recipe_field(text):
            text = f"{section}: {text}"  # every message names a field; this is a safety net
        raise RecipeError(text) from None


def _names_recipe_field(text: str) -> bool:
    return any(v in text for v in FIELD_NAMES.values())


# Where a recipe is checked without a model at hand; no config reads the path on construction.
PLACEHOLDER_MODEL_PATH = "<model.path>"


def trainer_config(recipe: Recipe, model_path: str) -> TrainerConfig:
    """The policy trainer's config. A reference model is kept when any KL term is on."""
    alg, tr = recipe.algorithm, recipe.trainer
    return _build(
        lambda: TrainerConfig(
            model_path=model_path,
            backend=tr.backend,
            tensor_model_parallel_size=tr.tp,
            pipeline_model_parallel_size=tr.pp,
            max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch,
            dtype=recipe.model.dtype,
            compile=tr.compile,
            share_prompts=tr.share_prompts,
            optim=OptimConfig(
                lr=tr.lr,
                min_lr=tr.min_lr,
                weight_decay=tr.weight_decay,
                grad_clip=tr.grad_clip,
                lr_schedule=tr.lr_schedule,
                warmup_steps=tr.warmup_steps,
                total_steps=recipe.steps * tr.updates_per_rollout,
            ),
            loss=LossConfig(
                policy_loss="gspo" if alg.gspo else "ppo",
                clip_low=alg.clip_low,
                clip_high=alg.clip_high,
                dual_clip=alg.dual_clip,
                agg_mode=alg.loss_agg,
                kl_coef=alg.kl_coef,
                kl_kind=alg.kl_type,
                entropy_coef=alg.entropy_coef,
                is_correction=alg.is_correction,
                is_cap=alg.is_cap,
                # the trainer's log-probs must be of the distribution the engine sampled
                temperature=recipe.rollout.temperature,
            ),
            use_reference=alg.kl_coef > 0 or alg.kl_reward_coef > 0,
            zero_stage=tr.zero_stage,
        ),
        "trainer",
    )


def critic_config(recipe: Recipe, model_path: str) -> TrainerConfig:
    """The PPO critic's config: the policy's, with the critic's learning rate, no reference."""
    policy = trainer_config(recipe, model_path)
    return _build(
        lambda: dataclasses.replace(
            policy,
            optim=dataclasses.replace(policy.optim, lr=recipe.trainer.critic_lr),
            use_reference=False,
            loss=dataclasses.replace(policy.loss, kl_coef=0.0),
        ),
        "trainer",
    )


def engine_config(recipe: Recipe, model_path: str, device: str = "cpu") -> EngineConfig:
    r = recipe.rollout
    backend = r.attention_backend
    if backend == "auto":  # engine TP runs the torch backend (rollout/parallel_layers.py)
        backend = "triton" if device.startswith("cuda") and r.tp == 1 else "torch"
    return _build(
        lambda: EngineConfig(
            model_path=model_path,
            device=device,
            dtype=recipe.model.dtype,
            attention_backend=backend,
            decode_graphs=r.decode_graphs,
            compile=r.compile,
            tensor_parallel_size=r.tp,
            kv_cache_tokens=r.kv_cache_tokens,
            page_size=r.page_size,
            max_running_requests=r.max_running_requests,
            speculative_method=r.speculative_method,
            num_speculative_tokens=r.num_speculative_tokens,
            speculative_draft_model_path=(
                str(Path(r.speculative_draft_model_path).expanduser())
                if r.speculative_draft_model_path
                else None
            ),
            seed=recipe.seed,
        ),
        "rollout",
    )


def sampling_params(recipe: Recipe, seed: int | None = None) -> SamplingParams:
    r = recipe.rollout
    return _build(
        lambda: SamplingParams(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            ignore_eos=r.ignore_eos,
            seed=seed,
        ),
        "rollout",
    )


def check_configs(recipe: Recipe) -> None:
    """Every config the recipe maps onto accepts it (RecipeError naming the recipe field)."""
    trainer_config(recipe, PLACEHOLDER_MODEL_PATH)
    if recipe.algorithm.advantage == "gae":
        critic_config(recipe, PLACEHOLDER_MODEL_PATH)
    engine_config(recipe, PLACEHOLDER_MODEL_PATH, device_type(recipe.cluster.accelerator))
    sampling_params(recipe)
