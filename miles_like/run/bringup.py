"""Bring-up: a recipe (or a checkpoint) becomes a running `Run`. In order:

1. what can fail in seconds, before any actor starts: the tokenizer, the model's context, the
   rollout function, the prompt data (`read_inputs`);
2. Ray and the placement group (`placement`);
3. the trainer ranks, then the warm start on them, or the checkpoint's weights (`warm_start`);
4. the trainer ranks build the policy (and critic) while the engines start on the same weights
   (`start_trainers_and_engines`); a resumed run loads every rank's training state;
5. the weight push's groups, the HTTP front, the rollout manager (`start`).

Anything that fails on the way releases what was started (every actor with the placement group).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from pathlib import Path
from typing import NamedTuple

from miles_like.data import PromptSource
from miles_like.errors import RecipeError
from miles_like.models.store import base_model_dir, read_model_files
from miles_like.models.tokenizer import HFTokenizer, load_tokenizer
from miles_like.recipe.build_configs import context_len, critic_config, trainer_config
from miles_like.recipe.preflight import replays_routes
from miles_like.rollouts.functions import resolve_rollout_function
from miles_like.rollouts.manager import RolloutManager
from miles_like.run import checkpoint, placement
from miles_like.run.actors import RunActors
from miles_like.run.calls import start_on_all, wait_all
from miles_like.run.http_front import HttpFront
from miles_like.run.warm_start import warm_start
from miles_like.run.weight_push import bucket_bytes_for, weight_push
from miles_like.scoring.rewards import resolve_reward


class Run(NamedTuple):
    """A started run: its actors, the rollouts they generate, the prompts those are drawn from."""

    actors: RunActors
    rollouts: RolloutManager
    source: PromptSource
    tokenizer: HFTokenizer
    resumed: dict | None  # the state.json of the checkpoint it continues, or None

    def layout_state(self) -> dict:
        """What a resumed run must match: the trainer layout and the data's row count."""
        return {
            **checkpoint.trainer_layout(self.actors.recipe, len(self.actors.trainers)),
            "data_rows": self.source.num_rows,
        }

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the rollouts, then release every actor (`RunActors.shutdown`)."""
        self.rollouts.close()
        self.actors.shutdown(graceful)


class Inputs(NamedTuple):
    """What the run reads before any actor starts: a bad file or module fails in seconds, not
    minutes."""

    base_dir: Path  # the model: the user's directory, or a built-in one in the cache
    tokenizer: HFTokenizer
    context_len: int  # the model's context, capped by trainer.max_tokens_per_micro_batch
    vocab_size: int
    max_prompt_tokens: int
    rollout_fn: object
    source: PromptSource
    replay_routes: bool  # algorithm.routing_replay resolved for the model (`replays_routes`)


class Weights(NamedTuple):
    """Where the run's weights come from."""

    model_dir: Path  # the policy's (the warm start's, or the checkpoint's)
    engine_dir: Path  # the engines' (an off-policy checkpoint's are one version behind)
    reference_dir: Path | None  # the frozen reference of a KL term, where there is one


def read_inputs(recipe, state: dict | None) -> Inputs:
    base_dir = base_model_dir(recipe.model, recipe.seed)
    try:
        tokenizer = load_tokenizer(base_dir)
    except ValueError as e:
        raise RecipeError(str(e)) from None
    hf = json.loads((base_dir / "config.json").read_text())
    context = context_len(recipe, base_dir)
    rollout_fn = resolve_rollout_function(recipe.rollout.function)
    max_prompt = context - recipe.rollout.max_new_tokens
    if max_prompt < 1:
        raise RecipeError(
            f"rollout.max_new_tokens={recipe.rollout.max_new_tokens} leaves no "
            f"room for a prompt in the model's context of {context}; lower it"
        )
    source = PromptSource(recipe.data, tokenizer, seed=recipe.seed, max_prompt_tokens=max_prompt)
    if state is not None:
        if source.num_rows != state["data_rows"]:
            raise RecipeError(
                f"data.path: {source.num_rows} usable rows now, "
                f"{state['data_rows']} when the checkpoint was written; resume "
                "with the same data"
            )
        source.skip_to(state["data_consumed"])
    return Inputs(
        base_dir,
        tokenizer,
        context,
        hf["vocab_size"],
        max_prompt,
        rollout_fn,
        source,
        replays_routes(recipe, hf),
    )


def start(recipe, log=print, resume: Path | None = None, state: dict | None = None) -> Run:
    """`resume`: a complete checkpoint directory (`checkpoint.py`) whose weights and training
    state the actors start from instead of the model / warm start; `state` its state.json."""
    layout = placement.plan(recipe.cluster, recipe.rollout.tp)
    if state is not None:
        checkpoint.check_same_layout(recipe, state, len(layout.trainer_bundles))
    inputs = read_inputs(recipe, state)
    placement.start_ray(recipe.cluster, layout)
    pg = placement.reserve(layout, strategy=recipe.cluster.placement_strategy)
    tag = uuid.uuid4().hex[:8]  # this run's actor names: miles_like.{tag}.*
    timeout_s = recipe.cluster.call_timeout_s
    trainers, replicas, actors = [], [], None
    try:
        trainers = placement.create_trainers(layout, pg, tag, timeout_s)
        weights = run_weights(recipe, inputs, trainers, resume, log)
        replicas, reference_dir = start_trainers_and_engines(
            recipe, layout, pg, tag, trainers, weights, resume, inputs.replay_routes
        )
        actors = RunActors(
            recipe,
            layout,
            pg,
            tag,
            trainers,
            replicas,
            weight_push(
                layout,
                recipe.trainer,
                trainers,
                replicas,
                bucket_bytes_for(weights.model_dir),
                timeout_s,
                recipe.rollout.quantization,
            ),
            # config and tokenizer files, kept in memory: the directory may be deleted
            read_model_files(weights.model_dir, skip=checkpoint.OWN_FILES),
            reference_dir,
            weight_version=state["weight_version"] if state else 0,
            log=log,
            replay_routes=inputs.replay_routes,
        )
        if actors.weight_version:
            actors.set_engines_version()
        actors.push.join()
        if recipe.rollout.serve_http:
            actors.front = HttpFront(
                actors.engines,
                inputs.tokenizer.tok,
                timeout_s,
                recipe.rollout.http_host,
                recipe.rollout.api_key,
                recipe.rollout.prefill_replicas,
            )
            log(f"rollout.serve_http: OpenAI-compatible router at {actors.front.base_url}")
        rollouts = start_rollouts(recipe, actors, inputs, state, log)
    except BaseException:
        if actors is not None:
            actors.shutdown(graceful=False)
        else:
            placement.release(pg, trainers + [a for ranks in replicas for a in ranks])
        raise
    return Run(actors, rollouts, inputs.source, inputs.tokenizer, state)


def start_rollouts(recipe, actors: RunActors, inputs: Inputs, state: dict | None, log):
    """The rollout manager, on the engines' list (shared: a replaced engine is the rollouts'
    too); a resumed run's with the partial groups its checkpoint's pending rollout continued."""
    rollouts = RolloutManager(
        recipe,
        actors.engines,
        inputs.tokenizer,
        resolve_reward(recipe.reward.function),
        inputs.source,
        rollout_fn=inputs.rollout_fn,
        context_len=inputs.context_len,
        vocab_size=inputs.vocab_size,
        restart_engine=actors.restart_engine,
        log=log,
        front=actors.front,
    )
    if state is not None:
        rollouts.restore_carry(state.get("carried", []))
    return rollouts


def run_weights(recipe, inputs: Inputs, trainers: list, resume: Path | None, log) -> Weights:
    """A fresh run starts from the model, or from its warm start (trained here, on the trainer
    ranks, or found in the cache); a resumed one takes every weight from the checkpoint."""
    if resume is None:
        model_dir = warm_start(
            recipe, inputs.base_dir, trainers, inputs.tokenizer, inputs.max_prompt_tokens, log=log
        )
        # the weights the run started from: the frozen reference of a KL term
        return Weights(model_dir, model_dir, model_dir)
    reference = resume / checkpoint.REFERENCE_DIR
    engine = resume / checkpoint.ENGINE_DIR
    return Weights(
        resume,
        engine if engine.is_dir() else resume,
        reference if reference.is_dir() else None,
    )


def start_trainers_and_engines(
    recipe,
    layout,
    pg,
    tag: str,
    trainers: list,
    weights: Weights,
    resume: Path | None,
    replay_routes: bool = False,
) -> tuple[list[list], Path | None]:
    """The trainer ranks build the policy (and the critic) while the engines start, in separate
    processes: megatron's import and the engines' start-up overlap. Except where an engine sizes
    its KV cache by the free memory of a device the trainer's weights are still filling. Returns
    every engine replica's ranks and the reference's directory (None without a KL term)."""
    timeout_s = recipe.cluster.call_timeout_s
    policy = trainer_config(recipe, str(weights.model_dir))
    reference_dir = weights.reference_dir if policy.use_reference else None
    if policy.use_reference:
        if reference_dir is None:
            raise RecipeError(
                f"checkpoint.resume: {resume} holds no reference model "
                "(its run had no KL term); resume with algorithm.kl_coef and "
                "kl_reward_coef at 0"
            )
        policy = dataclasses.replace(policy, reference_path=str(reference_dir))
    gae = recipe.algorithm.advantage == "gae"
    critic = critic_config(recipe, str(weights.model_dir)) if gae else None
    off_policy = recipe.cluster.off_policy_steps == 1
    build = start_on_all(
        "trainer rank",
        trainers,
        "build",
        policy,
        critic,
        recipe.algorithm.value_clip,
        off_policy,
        str(weights.engine_dir) if off_policy and resume is not None else None,
    )
    if layout.staged_memory and recipe.rollout.kv_cache_tokens is None:
        wait_all(build, timeout_s)
    replicas = placement.create_engines(
        layout,
        pg,
        placement.engine_settings(recipe, layout, weights.engine_dir),
        [placement.engine_name(tag, i) for i in range(layout.num_replicas)],
        timeout_s,
        return_routes=replay_routes,  # a mixture's routes, for the trainer to replay
    )
    wait_all(build, timeout_s)
    if resume is not None:
        checkpoint.load_trainer_states(trainers, resume, timeout_s)
    return replicas, reference_dir
