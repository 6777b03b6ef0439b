"""The recipe mapped onto the configs of the packages it drives: `trainer.TrainerConfig` (policy
and critic, with their `OptimConfig` and `LossConfig`), `rollout.EngineConfig` and
`rollout.SamplingParams`.

A config field has the name of the recipe field it comes from, so each config is built from
one section (its `prefix`): `EngineConfig.tp` is `rollout.tp`, `LossConfig.kl_type` is
`algorithm.kl_type`. The few fields taken from elsewhere are listed beside each builder (`*_FROM`),
and the configs' own checks (types, ranges, their rules across fields) name the recipe's fields
through that mapping, so a user sees the field they wrote. The recipe does not repeat the
configs' checks: building a `Recipe` runs `check_configs`, which builds them. (So `recipe`, a
`miles_like.recipe.Recipe`, is not imported here.)
"""

from __future__ import annotations

import json
from pathlib import Path

from config_schema import validate
from miles_like.errors import RecipeError
from rollout.config import EngineConfig, SamplingParams
from trainer.config import LossConfig, OptimConfig, TrainerConfig

# config field -> the recipe field it comes from, where that is not `<section>.<same name>`
TRAINER_FROM = {"model_path": "model.path", "dtype": "model.dtype"}
OPTIM_FROM = {"total_steps": "steps"}
CRITIC_OPTIM_FROM = {"lr": "trainer.critic_lr", "total_steps": "steps"}
LOSS_FROM = {"temperature": "rollout.temperature"}
ENGINE_FROM = {
    "model_path": "model.path",
    "dtype": "model.dtype",
    "seed": "seed",
    "device": "cluster.accelerator",
    "max_model_len": "trainer.max_tokens_per_micro_batch",
}

# Where a recipe is checked without a model at hand; no config reads the path on construction.
PLACEHOLDER_MODEL_PATH = "<model.path>"


def trainer_config(recipe, model_path: str) -> TrainerConfig:
    """The policy trainer's config. A reference model is kept when any KL term is on."""
    alg = recipe.algorithm
    return _trainer_config(
        recipe,
        model_path,
        lr=recipe.trainer.lr,
        optim_from=OPTIM_FROM,
        kl_coef=alg.kl_coef,
        use_reference=alg.kl_coef > 0 or alg.kl_reward_coef > 0,
    )


def critic_config(recipe, model_path: str) -> TrainerConfig:
    """The PPO critic's config: the policy's, with the critic's learning rate, no reference."""
    return _trainer_config(
        recipe,
        model_path,
        lr=recipe.trainer.critic_lr,
        optim_from=CRITIC_OPTIM_FROM,
        kl_coef=0.0,
        use_reference=False,
    )


def _trainer_config(
    recipe,
    model_path: str,
    *,
    lr: float,
    optim_from: dict[str, str],
    kl_coef: float,
    use_reference: bool,
) -> TrainerConfig:
    alg, tr = recipe.algorithm, recipe.trainer
    optim = validate(
        OptimConfig,
        dict(
            lr=lr,
            min_lr=tr.min_lr,
            weight_decay=tr.weight_decay,
            grad_clip=tr.grad_clip,
            lr_schedule=tr.lr_schedule,
            warmup_steps=tr.warmup_steps,
            total_steps=recipe.steps * tr.updates_per_rollout,
        ),
        prefix="trainer",
        names=optim_from,
        error=RecipeError,
    )
    loss = validate(
        LossConfig,
        dict(
            policy_loss=alg.policy_loss,
            clip_low=alg.clip_low,
            clip_high=alg.clip_high,
            dual_clip=alg.dual_clip,
            loss_agg=alg.loss_agg,
            kl_coef=kl_coef,
            kl_type=alg.kl_type,
            entropy_coef=alg.entropy_coef,
            is_correction=alg.is_correction,
            is_cap=alg.is_cap,
            # the trainer's log-probs must be of the distribution the engine sampled
            temperature=recipe.rollout.temperature,
        ),
        prefix="algorithm",
        names=LOSS_FROM,
        error=RecipeError,
    )
    return validate(
        TrainerConfig,
        dict(
            model_path=model_path,
            backend=tr.backend,
            tp=tr.tp,
            pp=tr.pp,
            max_tokens_per_micro_batch=tr.max_tokens_per_micro_batch,
            dtype=recipe.model.dtype,
            compile=tr.compile,
            share_prompts=tr.share_prompts,
            distributed_optimizer=tr.distributed_optimizer,
            moe_aux_loss_coeff=tr.moe_aux_loss_coeff,
            optim=optim,
            loss=loss,
            use_reference=use_reference,
            zero_stage=tr.zero_stage,
        ),
        prefix="trainer",
        names=TRAINER_FROM,
        error=RecipeError,
    )


def engine_config(recipe, model_path: str, device: str = "cpu") -> EngineConfig:
    r = recipe.rollout
    draft = r.speculative_draft_model_path
    return validate(
        EngineConfig,
        dict(
            model_path=model_path,
            device=device,
            dtype=recipe.model.dtype,
            attention_backend=attention_backend(
                r.attention_backend, device, recipe.model.dtype, r.tp
            ),
            decode_graphs=r.decode_graphs,
            compile=r.compile,
            tp=r.tp,
            kv_cache_tokens=r.kv_cache_tokens,
            kv_memory_fraction=r.kv_memory_fraction,
            kv_cache_dtype=r.kv_cache_dtype,
            max_model_len=context_len(recipe, model_path),
            page_size=r.page_size,
            max_running_requests=r.max_running_requests,
            speculative_method=r.speculative_method,
            num_speculative_tokens=r.num_speculative_tokens,
            speculative_draft_model_path=str(Path(draft).expanduser()) if draft else None,
            quantization=r.quantization,
            seed=recipe.seed,
        ),
        prefix="rollout",
        names=ENGINE_FROM,
        error=RecipeError,
    )


def attention_backend(requested: str, device: str, dtype: str, tp: int) -> str:
    """The engine's attention backend for `rollout.attention_backend`. "auto": the Triton kernels
    on CUDA, except under engine TP (its layers run the torch backend: rollout/parallel_layers.py)
    and for a float64 model (the Triton decode kernel computes in float32: a float64 pool attends
    through torch, so engine and trainer log-probs keep agreeing to float64 rounding); torch
    elsewhere. An explicit choice is kept (EngineConfig refuses triton with float64)."""
    if requested != "auto":
        return requested
    triton = device.startswith("cuda") and tp == 1 and dtype != "float64"
    return "triton" if triton else "torch"


def context_len(recipe, model_dir: str | Path) -> int:
    """The longest sequence of the run, prompt and every turn: the model's context
    (`max_position_embeddings` in its config.json, when there is one to read) capped by
    `trainer.max_tokens_per_micro_batch` (a longer sample could not be trained on). The engine
    sizes its per-sequence tables and static decode buffers by it (`EngineConfig.max_model_len`),
    not by the model's maximum."""
    cap = recipe.trainer.max_tokens_per_micro_batch
    config = Path(model_dir) / "config.json"
    if not config.is_file():  # a recipe checked without its model (PLACEHOLDER_MODEL_PATH)
        return cap
    return min(json.loads(config.read_text()).get("max_position_embeddings", cap), cap)


def sampling_params(recipe, seed: int | None = None) -> SamplingParams:
    r = recipe.rollout
    return validate(
        SamplingParams,
        dict(
            n=r.n,
            temperature=r.temperature,
            top_p=r.top_p,
            top_k=r.top_k,
            max_new_tokens=r.max_new_tokens,
            ignore_eos=r.ignore_eos,
            seed=seed,
        ),
        prefix="rollout",
        error=RecipeError,
    )


def check_configs(recipe) -> None:
    """Every config the recipe maps onto accepts it (RecipeError naming the recipe field)."""
    trainer_config(recipe, PLACEHOLDER_MODEL_PATH)
    if recipe.algorithm.advantage == "gae":
        critic_config(recipe, PLACEHOLDER_MODEL_PATH)
    engine_config(recipe, PLACEHOLDER_MODEL_PATH, recipe.cluster.device_type())
    sampling_params(recipe)
