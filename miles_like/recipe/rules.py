"""The rules between the recipe's sections, run whenever a `Recipe` is built (loaded, or made in
code). Each rule takes the sections it reads; each failure is one `RecipeError` line naming the
fields involved and the fix. The rules within one section are the section's own `check`
(`sections.py`); those of the engine and trainer configs, theirs (`build_configs.check_configs`).
"""

from __future__ import annotations

from miles_like.errors import RecipeError
from miles_like.recipe.sections import (
    AlgorithmSection,
    CheckpointSection,
    ClusterSection,
    DataSection,
    RolloutSection,
    TrainerSection,
)

# estimators whose baseline is the other samples of the prompt
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def check_sections(
    *,
    data: DataSection,
    rollout: RolloutSection,
    algorithm: AlgorithmSection,
    trainer: TrainerSection,
    cluster: ClusterSection,
    checkpoint: CheckpointSection,
) -> None:
    """Every rule below, in this order (the first broken one is reported)."""
    check_algorithm(rollout, algorithm)
    check_devices(rollout, trainer, cluster)
    if rollout.prefill_replicas:
        check_prefill_decode(rollout, cluster)
    check_trainer(rollout, algorithm, trainer, cluster, checkpoint)
    if rollout.function == "tool_loop" and not data.chat_template:
        raise RecipeError(
            "rollout.function=tool_loop renders tool calls and results with "
            "the chat template; set data.chat_template: true"
        )
    if cluster.fully_async:
        check_fully_async(rollout, trainer, cluster)
    else:
        check_over_sampling(rollout, algorithm, cluster)
    check_lengths(rollout, trainer)


def check_algorithm(rollout: RolloutSection, alg: AlgorithmSection) -> None:
    if alg.advantage in GROUP_ESTIMATORS and rollout.n < 2:
        raise RecipeError(
            f"rollout.n={rollout.n}: algorithm.advantage={alg.advantage} "
            "compares samples of a prompt; use rollout.n >= 2"
        )
    if alg.dynamic_sampling and rollout.n < 2:
        raise RecipeError(
            "algorithm.dynamic_sampling needs groups; set rollout.n >= 2 or "
            "algorithm.dynamic_sampling: false"
        )
    if alg.overlong_buffer >= rollout.max_new_tokens:
        raise RecipeError(
            f"algorithm.overlong_buffer={alg.overlong_buffer} must be below "
            f"rollout.max_new_tokens={rollout.max_new_tokens}; lower it"
        )
    low_precision = [
        f"{field}={value}"
        for field, value in (
            ("rollout.quantization", rollout.quantization),
            ("rollout.kv_cache_dtype", rollout.kv_cache_dtype),
        )
        if value not in (None, "auto")
    ]
    if low_precision and alg.is_correction is None:
        # the engine samples from FP8 weights or FP8 K/V, the trainer computes in the model
        # dtype: their log-probs differ, and only an importance correction keeps the update
        # on-policy
        raise RecipeError(
            f"{' and '.join(low_precision)} samples from a rounded policy; set "
            "algorithm.is_correction: tis (or mis) to correct for it, or drop the FP8 setting"
        )
    if alg.kl_reward_coef > 0 and alg.advantage not in ("reinforce_pp", "gae"):
        raise RecipeError(
            f"algorithm.kl_reward_coef applies to reinforce_pp and gae, not "
            f"{alg.advantage}; use algorithm.kl_coef (KL as a loss term)"
        )


def check_devices(
    rollout: RolloutSection, trainer: TrainerSection, cluster: ClusterSection
) -> None:
    """The trainer's TP x PP and the engine's TP fit the devices each side gets."""
    model_parallel = trainer.tp * trainer.pp
    if cluster.colocate and cluster.devices % model_parallel:
        raise RecipeError(
            f"cluster.devices={cluster.devices} is not a multiple of "
            f"trainer.tp x trainer.pp = {model_parallel}; change one of them"
        )
    trainer_devices = (
        cluster.devices
        if cluster.colocate
        else cluster.devices - (cluster.rollout_devices or cluster.devices // 2)
    )
    if not cluster.colocate and trainer_devices % model_parallel:
        raise RecipeError(
            f"cluster: {trainer_devices} trainer devices (cluster.devices - "
            "cluster.rollout_devices) is not a multiple of trainer.tp x "
            f"trainer.pp = {model_parallel}; change one"
        )
    engine_devices = cluster.devices if cluster.colocate else cluster.devices - trainer_devices
    if engine_devices % rollout.tp:
        raise RecipeError(
            f"rollout.tp={rollout.tp} must divide the {engine_devices} engine devices "
            "(cluster.devices, or cluster.rollout_devices when not colocated); change one"
        )


def engine_replicas(rollout: RolloutSection, cluster: ClusterSection) -> int:
    """How many engine replicas the placement makes (`check_devices` holds)."""
    if cluster.colocate:
        return cluster.devices // rollout.tp
    return (cluster.rollout_devices or cluster.devices // 2) // rollout.tp


def check_prefill_decode(rollout: RolloutSection, cluster: ClusterSection) -> None:
    """rollout.prefill_replicas leaves a decode replica, and nothing it does not serve yet."""
    k, replicas = rollout.prefill_replicas, engine_replicas(rollout, cluster)
    if k >= replicas:
        raise RecipeError(
            f"rollout.prefill_replicas={k} leaves no decode replica of the {replicas} engine "
            "replicas; lower it, or give the engines more devices (cluster.devices / "
            "cluster.rollout_devices)"
        )
    # Engine TP is served: every replica, prefill or decode, has rollout.tp ranks (one size for
    # all), and a handoff carries every KV head whatever either side's TP.
    # cluster.fully_async: the producer's waves are prefilled on the prefill replicas and decoded
    # on the others (`async_producer/disaggregated.py`); a multi-turn function's engine calls
    # are not (each goes to its group's replica whole)
    unsupported = {
        "rollout.speculative_method=draft": rollout.speculative_method == "draft",
        f"cluster.fully_async with rollout.function={rollout.function!r} (multi-turn)": (
            cluster.fully_async and rollout.function != "single_turn"
        ),
    }
    for what, used in unsupported.items():
        if used:
            raise RecipeError(
                f"rollout.prefill_replicas={k}: prefill-decode disaggregation does not support "
                f"{what} yet; turn one of them off"
            )


def check_trainer(
    rollout: RolloutSection,
    alg: AlgorithmSection,
    trainer: TrainerSection,
    cluster: ClusterSection,
    checkpoint: CheckpointSection,
) -> None:
    """What the chosen backend can do with this batch, placement and checkpointing."""
    samples = rollout.prompts_per_step * rollout.n
    if trainer.updates_per_rollout > samples:
        raise RecipeError(
            f"trainer.updates_per_rollout={trainer.updates_per_rollout} "
            f"exceeds the {samples} samples per step (rollout.prompts_per_step "
            "x rollout.n); lower it"
        )
    if alg.advantage == "gae" and trainer.backend != "megatron":
        raise RecipeError(
            "algorithm.advantage=gae trains a critic, which the megatron "
            "backend provides; set trainer.backend: megatron"
        )
    zero3 = trainer.backend == "deepspeed" and trainer.zero_stage == 3
    if zero3 and cluster.colocate and cluster.device_type() == "cuda":
        raise RecipeError(
            "trainer.zero_stage=3: colocated on GPU the trainer must offload "
            "its state for the engine, which deepspeed's ZeRO-3 cannot do with "
            "torch's Adam; use trainer.zero_stage 1 or 2, or "
            "cluster.colocate: false"
        )
    if zero3 and checkpoint.every_steps:
        raise RecipeError(
            "checkpoint.every_steps: checkpoints of the deepspeed backend "
            "need trainer.zero_stage 1 or 2; lower it or set "
            "checkpoint.every_steps: 0"
        )


def check_over_sampling(
    rollout: RolloutSection, alg: AlgorithmSection, cluster: ClusterSection
) -> None:
    """rollout.over_sampling / partial / stream_scoring in synchronous training
    (`rollouts/oversampling.py`)."""
    over = rollout.over_sampling > 1
    if rollout.partial is not None and not over:
        raise RecipeError(
            f"rollout.partial={rollout.partial} needs groups left over: set "
            "rollout.over_sampling > 1 (e.g. 1.5), or rollout.partial: null"
        )
    if over and rollout.partial is None:
        raise RecipeError(
            f"rollout.over_sampling={rollout.over_sampling:g} leaves unfinished groups: "
            "say what happens to them with rollout.partial: abort | retract"
        )
    if rollout.partial == "in_place" and cluster.colocate:
        raise RecipeError(
            "rollout.partial=in_place keeps KV across the weight update, but colocated "
            "engines release their KV for training; use rollout.partial: retract"
        )
    if rollout.max_carry_versions is not None and rollout.partial not in ("retract", "in_place"):
        raise RecipeError(
            f"rollout.max_carry_versions={rollout.max_carry_versions} bounds carried "
            "groups, but rollout.partial is not retract or in_place; set one, or "
            "rollout.max_carry_versions: null"
        )
    field = "over_sampling" if over else "stream_scoring"
    if (over or rollout.stream_scoring) and rollout.function != "single_turn":
        raise RecipeError(
            f"rollout.{field} works with rollout.function: single_turn (a multi-turn "
            f"function's groups finish at controller-timed moments), not "
            f"{rollout.function!r}"
        )
    if (over or rollout.stream_scoring) and alg.dynamic_sampling:
        raise RecipeError(
            f"rollout.{field} and algorithm.dynamic_sampling both choose which groups a "
            "step trains on; use one of them"
        )


def check_fully_async(
    rollout: RolloutSection, trainer: TrainerSection, cluster: ClusterSection
) -> None:
    """cluster.fully_async (`rollouts/async_producer.py`, `rollouts/agents.py`): its own choice
    of which groups are trained (no over-sampling, streaming always on; dynamic sampling filters
    the buffer); multi-turn functions continue their calls after an update."""
    if rollout.over_sampling > 1:
        raise RecipeError(
            "rollout.over_sampling: cluster.fully_async=true keeps the engines full by "
            "itself (cluster.async_buffer_groups); set rollout.over_sampling: 1"
        )
    if (
        rollout.partial == "in_place"
        and rollout.tp > 1
        and trainer.tp == rollout.tp
        and trainer.backend == "megatron"
    ):
        raise RecipeError(
            f"rollout.partial=in_place updates running engines with full tensors, but "
            f"trainer.tp = rollout.tp = {rollout.tp} (megatron) syncs each TP rank its own "
            "shards, which needs idle engines; use rollout.partial: retract"
        )
    if rollout.max_carry_versions is not None:
        raise RecipeError(
            "rollout.max_carry_versions bounds synchronous over-sampling; "
            "cluster.fully_async=true bounds staleness with cluster.max_staleness: "
            "remove rollout.max_carry_versions"
        )
    if rollout.function != "single_turn" and rollout.partial == "in_place":
        raise RecipeError(
            f"rollout.partial=in_place keeps single-turn requests running through an "
            f"update; rollout.function={rollout.function!r} continues its engine calls "
            "after it: use rollout.partial: retract (or null)"
        )
    if rollout.function != "single_turn" and rollout.serve_http:
        raise RecipeError(
            "rollout.serve_http: cluster.fully_async=true tracks each engine call's weight "
            "versions through ctx.generate, which HTTP requests bypass; set "
            "rollout.serve_http: false"
        )
    buffer = cluster.async_buffer_groups
    if buffer is not None and buffer < rollout.prompts_per_step:
        raise RecipeError(
            f"cluster.async_buffer_groups={buffer} cannot hold one batch of "
            f"rollout.prompts_per_step={rollout.prompts_per_step} groups; raise it to "
            f">= {rollout.prompts_per_step} or null"
        )


def check_lengths(rollout: RolloutSection, trainer: TrainerSection) -> None:
    """A response (or a whole trajectory) leaves room for a prompt in a micro-batch."""
    total, micro_batch = rollout.max_trajectory_tokens, trainer.max_tokens_per_micro_batch
    if total is not None and total < rollout.max_new_tokens:
        raise RecipeError(
            f"rollout.max_trajectory_tokens={total} is below "
            f"rollout.max_new_tokens={rollout.max_new_tokens} (one turn); "
            "raise it or lower rollout.max_new_tokens"
        )
    if total is not None and total >= micro_batch:
        raise RecipeError(
            f"rollout.max_trajectory_tokens={total} leaves no room for a "
            f"prompt in trainer.max_tokens_per_micro_batch={micro_batch}; raise the latter"
        )
    if rollout.max_new_tokens >= micro_batch:
        raise RecipeError(
            f"rollout.max_new_tokens={rollout.max_new_tokens} leaves no room for "
            f"a prompt in trainer.max_tokens_per_micro_batch={micro_batch}; raise the latter"
        )
