"""The recipe: everything a run needs, as typed, documented, frozen dataclasses with defaults.

    recipe = load_recipe("recipes/tiny_arith_grpo.yaml", ["rollout.n=4", "trainer.lr=1e-5"])

A recipe YAML has the top-level keys `steps`, `seed` and one mapping per section below (`model`
and `data` are required). Every field is type- and range-checked when its section is built
(`schema.Section`); building the `Recipe` then checks that the trainer / engine configs it maps
onto accept it (their own validation, reported under the recipe's field names:
`build_configs.py`) and applies the cross-section rules. So a `Recipe` built in code is as
checked as a loaded one. `load_recipe` adds reading the file, the overrides and (unless
`check_paths_exist=False`) the filesystem checks. Every failure is one `RecipeError` line naming
the dotted field and the fix.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from miles_like.models.builtin import BUILTIN_MODELS
from miles_like.recipe.schema import RecipeError, Section, from_dict, setting, to_plain
from miles_like.tasks.arith import ArithSpec
from miles_like.tasks.chain import ChainSpec

__all__ = [
    "Recipe",
    "RecipeError",
    "load_recipe",
    "parse_overrides",
    "apply_overrides",
    "recipe_to_yaml",
    "check_paths",
]

# calc: arith's problems, solved with the calculator tool; chain: chains of operations answered
# step by step (tasks/chain.py), long-tailed lengths
SYNTHETIC_TASKS = ("arith", "calc", "chain")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


@dataclass(frozen=True)
class ModelSection(Section):
    PATH = "model"
    path: str | None = setting(
        None,
        "local Hugging Face model directory (config.json, "
        "*.safetensors, tokenizer files); set this or builtin",
    )
    builtin: str | None = setting(
        None,
        f"built-in tiny model with the character tokenizer: "
        f"{' | '.join(BUILTIN_MODELS)}; set this or path",
    )
    dtype: Literal["float32", "bfloat16", "float64"] = setting(
        "float32",
        "compute dtype of trainer and engine; float64 (megatron backend) makes the "
        "engine-vs-trainer log-prob gap exact to ~1e-12 for tiny CPU models",
    )

    def check(self) -> None:
        if (self.path is None) == (self.builtin is None):
            raise RecipeError(
                "model: set exactly one of model.path (a local Hugging Face "
                f"directory) or model.builtin ({' | '.join(BUILTIN_MODELS)})"
            )
        if self.builtin is not None and self.builtin not in BUILTIN_MODELS:
            raise RecipeError(
                f"model.builtin={self.builtin!r} is not a built-in model; use one "
                f"of {' | '.join(BUILTIN_MODELS)}"
            )


@dataclass(frozen=True)
class DataSection(Section):
    PATH = "data"
    path: str | None = setting(
        None, "local .jsonl / .json / .parquet file read with HF datasets; set this or synthetic"
    )
    synthetic: str | None = setting(
        None,
        "task generated on the fly: arith | calc (arith's "
        "problems; the warm start demonstrates the calculator tool "
        "when rollout.tools has it) | chain (chains of operations "
        "answered step by step: long-tailed lengths); set this or path",
    )
    prompt_key: str = setting("prompt", "column holding the prompt text")
    answer_key: str = setting("answer", "column holding the reference answer given to the reward")
    chat_template: bool = setting(True, "wrap prompts in the tokenizer's chat template")
    shuffle_seed: int | None = setting(0, "seed of the epoch shuffle; null keeps file order")
    arith_digits: int = setting(
        2, "synthetic arith / calc: operands have up to this many digits", ge=1, le=9
    )
    arith_ops: str = setting("+-", "synthetic arith / calc: operators to draw from (subset of +-*)")
    chain_max_ops: int = setting(
        12, "synthetic chain: at most this many operations per prompt", ge=1, le=64
    )
    chain_continue_p: float = setting(
        0.6,
        "synthetic chain: probability of one more operation after each (geometric "
        "lengths, mean 1 / (1 - p), capped by chain_max_ops)",
        ge=0.0,
        lt=1.0,
    )
    chain_ops: str = setting("+-", "synthetic chain: operators to draw from (subset of +-*)")
    chain_max_value: int = setting(
        99, "synthetic chain: running values stay in [0, this] (9: one digit each)", ge=9, le=9999
    )

    def check(self) -> None:
        if (self.path is None) == (self.synthetic is None):
            raise RecipeError(
                "data: set exactly one of data.path (a local .jsonl / .parquet "
                f"file) or data.synthetic ({' | '.join(SYNTHETIC_TASKS)})"
            )
        if self.synthetic is not None and self.synthetic not in SYNTHETIC_TASKS:
            raise RecipeError(
                f"data.synthetic={self.synthetic!r} is not a synthetic task; use "
                f"one of {' | '.join(SYNTHETIC_TASKS)}"
            )
        if self.path is not None and not self.path.endswith(DATA_SUFFIXES):
            raise RecipeError(f"data.path={self.path!r}: use a {' / '.join(DATA_SUFFIXES)} file")
        try:
            ArithSpec(self.arith_digits, self.arith_ops)
        except ValueError as e:  # "ops='/': use ..." names the task's field
            raise RecipeError(f"data.arith_{e}") from None
        try:
            ChainSpec(
                self.chain_max_ops, self.chain_continue_p, self.chain_ops, self.chain_max_value
            )
        except ValueError as e:
            raise RecipeError(f"data.chain_{e}") from None


@dataclass(frozen=True)
class RolloutSection(Section):
    PATH = "rollout"
    ALIASES = {
        "group_size": "n",
        "n_samples_per_prompt": "n",
        "batch_size": "prompts_per_step",
        "rollout_batch_size": "prompts_per_step",
        "max_tokens": "max_new_tokens",
        "max_response_length": "max_new_tokens",
    }
    prompts_per_step: int = setting(32, "prompts drawn per RL step", ge=1)
    n: int = setting(8, "samples per prompt (the group size)", ge=1)
    temperature: float = setting(1.0, "sampling temperature (> 0: RL samples)", gt=0.0)
    top_p: float = setting(1.0, "nucleus sampling mass, in (0, 1]")
    top_k: int = setting(-1, "top-k sampling; -1 disables it")
    max_new_tokens: int = setting(64, "longest response in tokens")
    ignore_eos: bool = setting(
        False,
        "sample exactly max_new_tokens tokens, past the EOS (fixed-length workloads, e.g. "
        "benchmarks); false stops at the EOS",
    )
    kv_cache_tokens: int | None = setting(
        None, "engine KV pool size in tokens; null: a fraction of free device memory"
    )
    page_size: int = setting(16, "engine KV page size in tokens (prefix-sharing unit)")
    max_running_requests: int = setting(256, "most sequences the engine decodes at once")
    speculative_method: Literal["ngram", "group", "draft"] | None = setting(
        None, "exact speculative decoding: ngram | group | draft | null (off)"
    )
    num_speculative_tokens: int = setting(4, "tokens drafted per speculative step", ge=1)
    speculative_draft_model_path: str | None = setting(
        None,
        "speculative_method=draft: local HF directory of a smaller model with the policy's "
        "vocabulary (its weights are not updated)",
    )
    attention_backend: Literal["auto", "torch", "triton"] = setting(
        "auto",
        "engine attention: torch (every device) | triton (CUDA kernels) | auto (triton "
        "on CUDA with rollout.tp 1, else torch)",
    )
    decode_graphs: bool | None = setting(
        None,
        "pure decode steps at static shapes, captured as CUDA graphs on a GPU; null: on "
        "with the triton backend on CUDA",
    )
    compile: bool = setting(
        False,
        "torch.compile the engine's forward outside attention (fused norm / rotary / MLP "
        "loops; compiles in the first steps; rounds differently from eager, so off for exact "
        "float64 runs); not with rollout.tp > 1",
    )
    tp: int = setting(
        1,
        "engine tensor-parallel size: devices per engine replica (k Ray actors, one "
        "scheduler on rank 0); must divide the model's attention and KV heads",
        ge=1,
    )
    function: str = setting(
        "single_turn",
        "rollout function: built-in single_turn | tool_loop, or module:function, "
        "an async fn(ctx, problem) -> list[Trajectory] returning the prompt's n trajectories "
        "(README, Rollout functions)",
    )
    max_turns: int = setting(
        1,
        "most model turns per trajectory a multi-turn rollout function takes (ctx.max_turns)",
        ge=1,
    )
    tools: tuple[str, ...] = setting(
        (),
        "module:function tools a multi-turn rollout function "
        "may call (ctx.tools): plain Python functions (schema from "
        "the annotations and docstring), each call run in a worker "
        "process (ctx.tool_pool)",
    )
    tool_timeout_s: float = setting(
        10.0,
        "longest a tool call may run; past it the worker is "
        "killed and the model gets an error result",
        gt=0.0,
    )
    tool_output_max_chars: int = setting(
        2000,
        "longest tool output; a longer one is refused "
        "with an error result (never truncated silently)",
        ge=1,
    )
    tool_workers: int = setting(2, "worker processes running tool calls", ge=1)
    tool_schemas_in_prompt: bool = setting(
        True,
        "tool_loop: the chat template shows the "
        "tools' schemas in a system turn (false: the model "
        "knows its tools from training, a shorter prompt)",
    )
    max_trajectory_tokens: int | None = setting(
        None,
        "tool_loop: most tokens after the prompt in a trajectory (sampled turns, tool "
        "results, template markers); null: what the context leaves",
        ge=1,
    )
    serve_http: bool = setting(
        False,
        "serve the engines as an OpenAI-compatible endpoint on "
        "127.0.0.1 behind a cache-aware router during rollouts "
        "(ctx.base_url, for agent code)",
    )
    over_sampling: float = setting(
        1.0,
        "launch ceil(prompts_per_step x this) groups a step; the first prompts_per_step to "
        "complete are the batch, the rest go by rollout.partial (single_turn only)",
        ge=1.0,
    )
    partial: Literal["abort", "retract", "in_place"] | None = setting(
        None,
        "over_sampling > 1: the unfinished groups are dropped (abort) or continue next step "
        "under the new weights, tokens kept, KV prefilled again (retract) or kept in the "
        "engine across the weight update (in_place, disaggregated only); cluster.fully_async: "
        "what an update does to running requests: abort, retract (null) or in_place (kept "
        "running on their K/V)",
    )
    max_carry_versions: int | None = setting(
        None,
        "partial retract / in_place: a group is carried across at most this many weight "
        "updates, then dropped (counted); null: no bound",
        ge=0,
    )
    stream_scoring: bool = setting(
        False,
        "score each group as soon as its n samples finish, overlapping generation "
        "(single_turn only; always on with over_sampling > 1)",
    )

    def check(self) -> None:
        from miles_like.rollouts.functions import check_rollout_spec  # imports nothing from here
        from miles_like.rollouts.tools import check_spec  # tools imports nothing from here

        check_rollout_spec(self.function)
        for i, spec in enumerate(self.tools):
            check_spec(spec, f"rollout.tools[{i}]")


@dataclass(frozen=True)
class AlgorithmSection(Section):
    PATH = "algorithm"
    ALIASES = {
        "advantage_estimator": "advantage",
        "eps_clip": "clip_low",
        "eps_clip_high": "clip_high",
        "kl_loss_coef": "kl_coef",
        "kl_loss_type": "kl_type",
        "loss_agg_mode": "loss_agg",
    }
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = setting(
        "grpo", "advantage estimator (gae trains a critic: PPO)"
    )
    clip_low: float = setting(0.2, "PPO ratio clip below: 1 - clip_low", ge=0.0)
    clip_high: float = setting(
        0.2, "PPO ratio clip above: 1 + clip_high (> clip_low: DAPO's clip-higher)", ge=0.0
    )
    dual_clip: float | None = setting(
        None, "dual-clip constant c > 1 for negative advantages; null disables it", gt=1.0
    )
    gspo: bool = setting(
        False, "sequence-level ratios (GSPO); use a far smaller clip range, e.g. 3e-4 / 4e-4"
    )
    loss_agg: str = setting(
        "token-mean", "loss aggregation: token-mean | seq-mean | seq-mean-token-sum"
    )
    kl_coef: float = setting(
        0.0, "KL-to-reference loss coefficient (> 0 keeps a reference model)", ge=0.0
    )
    kl_type: str = setting("low-var-kl", "KL estimator: k1 | k2 | k3 | low-var-kl")
    kl_reward_coef: float = setting(
        0.0,
        "per-token KL penalty folded into the reward "
        "(reinforce_pp, gae); > 0 keeps a reference model",
        ge=0.0,
    )
    entropy_coef: float = setting(0.0, "entropy bonus coefficient", ge=0.0)
    gamma: float = setting(1.0, "discount (reinforce_pp, gae)", ge=0.0, le=1.0)
    gae_lambda: float = setting(1.0, "GAE lambda (gae)", ge=0.0, le=1.0)
    value_clip: float | None = setting(0.2, "critic value clip (gae); null disables it", gt=0.0)
    dynamic_sampling: bool = setting(
        False,
        "drop groups whose rewards are all equal and oversample prompts to refill the batch "
        "(DAPO); cluster.fully_async: filtered from the buffer as they are scored",
    )
    dynamic_sampling_max_rounds: int = setting(
        4,
        "most extra generation rounds to refill a batch before training on what there is "
        "(fully_async: at most this x prompts_per_step groups filtered per batch)",
        ge=1,
    )
    overlong_buffer: int = setting(
        0,
        "DAPO soft overlong penalty: responses longer than "
        "max_new_tokens - buffer lose reward linearly; 0 disables it",
        ge=0,
    )
    overlong_penalty: float = setting(
        1.0, "reward lost at max_new_tokens (the penalty factor)", ge=0.0
    )
    is_correction: Literal["tis", "mis"] | None = setting(
        None, "engine-vs-trainer importance correction: tis | mis | null"
    )
    is_cap: float = setting(2.0, "tis / mis: cap of the importance weight", gt=0.0)


@dataclass(frozen=True)
class TrainerSection(Section):
    PATH = "trainer"
    ALIASES = {
        "learning_rate": "lr",
        "tensor_model_parallel_size": "tp",
        "pipeline_model_parallel_size": "pp",
        "micro_batch_tokens": "max_tokens_per_micro_batch",
    }
    backend: str = setting("megatron", "megatron | deepspeed")
    tp: int = setting(1, "tensor-parallel size", ge=1)
    pp: int = setting(1, "pipeline-parallel size", ge=1)
    lr: float = setting(1e-6, "peak learning rate", gt=0.0)
    min_lr: float = setting(0.0, "cosine schedule: final learning rate", ge=0.0)
    lr_schedule: str = setting(
        "constant", "constant | cosine (decays over steps x updates_per_rollout optimizer steps)"
    )
    warmup_steps: int = setting(0, "linear warmup, in optimizer steps")
    weight_decay: float = setting(0.0, "AdamW weight decay (not on 1-D params)", ge=0.0)
    grad_clip: float | None = setting(1.0, "max global grad norm; null disables clipping", gt=0.0)
    max_tokens_per_micro_batch: int = setting(4096, "packed tokens per micro-batch")
    updates_per_rollout: int = setting(1, "optimizer steps per rollout batch (mini-batches)", ge=1)
    zero_stage: int = setting(2, "deepspeed backend: ZeRO stage", ge=1, le=3)
    critic_lr: float = setting(1e-5, "gae: critic learning rate", gt=0.0)
    compile: bool = setting(
        False,
        "megatron backend: torch.compile the element-wise pieces (RMSNorm, rotary, SwiGLU; "
        "compiles in the first step; rounds differently from eager, so off for exact float64 "
        "runs)",
    )
    share_prompts: bool = setting(
        True,
        "megatron backend: a prompt shared by samples of a micro-batch (a GRPO group) is "
        "computed once, its responses attending to it as in their own sequences (the same "
        "function; float32 rounds differently)",
    )


@dataclass(frozen=True)
class SFTSection(Section):
    PATH = "sft"
    steps: int = setting(
        0,
        "supervised warm start: optimizer steps on (prompt, answer) pairs of "
        "the data before RL; 0 skips it",
        ge=0,
    )
    batch_size: int = setting(64, "pairs per warm-start step", ge=1)
    lr: float = setting(1e-3, "warm-start learning rate (constant)", gt=0.0)
    stop_loss: float | None = setting(
        None,
        "stop the warm start at the first step where the mean loss of the last "
        "sft.stop_window steps is below this (sft.steps is then the most it runs); "
        "null: always sft.steps",
        gt=0.0,
    )
    stop_window: int = setting(5, "steps the sft.stop_loss mean is taken over", ge=1)
    cache: bool = setting(
        True,
        "reuse a finished warm start with the same model, data, settings "
        "and seed from $MILES_LIKE_CACHE (default ~/.cache/miles_like)",
    )


@dataclass(frozen=True)
class ClusterSection(Section):
    PATH = "cluster"
    # `async` is a Python keyword, so the field is fully_async (verl's name for the mode)
    ALIASES = {"async": "fully_async"}
    devices: int = setting(1, "devices (GPUs; CPU slots without CUDA) in the placement group", ge=1)
    accelerator: Literal["auto", "cpu", "cuda"] = setting("auto", "auto: cuda when available")
    colocate: bool = setting(True, "trainer rank i and engine i share device i; phases alternate")
    rollout_devices: int | None = setting(
        None, "disaggregated only: devices for engines (the rest train); null: half", ge=1
    )
    off_policy_steps: Literal[0, 1] = setting(
        0, "1: rollout k+1 overlaps training k (disaggregated only)"
    )
    fully_async: bool = setting(
        False,
        "disaggregated only: engines generate without stopping into a bounded buffer; the "
        "trainer takes a batch when one is ready; weights reach the engines between their "
        "steps (running requests continue by rollout.partial, null: retract; a multi-turn "
        "function's engine calls continue from their tokens)",
    )
    max_staleness: int = setting(
        1,
        "fully_async: a group is trained at most this many weight versions after its oldest "
        "token was sampled, else dropped (counted); 0 reproduces the synchronous run",
        ge=0,
    )
    take_ahead: bool = setting(
        True,
        "fully_async, max_staleness >= 1: take the next step's batch while the trainer trains, "
        "so that the next train call starts right after the weight update (not in a step that "
        "checkpoints); false: take it after the update",
    )
    async_buffer_groups: int | None = setting(
        None,
        "fully_async: groups generating, waiting or being trained at once (back-pressure); "
        "null: rollout.prompts_per_step x (max_staleness + 1)",
        ge=1,
    )
    address: str | None = setting(
        None, "Ray cluster address (e.g. auto, ray://host:10001); null starts a local Ray"
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = setting(
        "PACK",
        "Ray placement-group strategy for the device bundles: PACK fills a node before "
        "the next; SPREAD deals bundles across nodes (bundle i = trainer rank / engine i)",
    )
    cpu_threads: int | None = setting(
        None,
        "torch CPU threads per trainer rank / engine; null: CPU cores // devices, at most "
        "$OMP_NUM_THREADS where it is set. 1 on a shared machine: a multi-threaded step whose "
        "threads wait for one another slows down many times when other processes hold the cores",
        ge=1,
    )
    pin_cpus: bool = setting(
        False,
        "disaggregated on CPU: pin each worker process to its own cpu_threads cores (bundle b: "
        "the b-th run of cpu_threads cores the controller may use), so the trainer and the "
        "engines do not migrate across the same cores; devices x cpu_threads must fit them",
    )
    call_timeout_s: float = setting(
        1800.0,
        "longest wait for one actor call (a rollout, a train "
        "step, a weight sync, a checkpoint) and for the weight-sync "
        "collectives; past it the run stops, naming the call",
        gt=0.0,
    )
    max_engine_restarts: int = setting(
        3,
        "engine replicas replaced in place over a run when one dies generating (either loop); "
        "a death past this many stops the run (0: the first one does)",
        ge=0,
    )

    def check(self) -> None:
        if self.pin_cpus and self.colocate:
            raise RecipeError(
                "cluster.pin_cpus=true gives each bundle's worker its own cores, but colocated "
                "trainer and engine share a bundle; set cluster.colocate: false"
            )
        if self.off_policy_steps == 1 and self.colocate:
            raise RecipeError(
                "cluster.off_policy_steps=1 needs disaggregated placement; set "
                "cluster.colocate: false or cluster.off_policy_steps: 0"
            )
        if not self.fully_async and (
            self.async_buffer_groups is not None or self.max_staleness != 1 or not self.take_ahead
        ):
            field = (
                "async_buffer_groups"
                if self.async_buffer_groups is not None
                else "max_staleness"
                if self.max_staleness != 1
                else "take_ahead"
            )
            raise RecipeError(
                f"cluster.{field} applies to fully asynchronous training; set "
                f"cluster.fully_async: true or remove cluster.{field}"
            )
        if self.fully_async and self.colocate:
            raise RecipeError(
                "cluster.fully_async=true keeps the engines generating while the trainer "
                "trains, so they need their own devices; set cluster.colocate: false"
            )
        if self.fully_async and self.off_policy_steps:
            raise RecipeError(
                "cluster.fully_async=true bounds the lag by cluster.max_staleness, not "
                "cluster.off_policy_steps; set cluster.off_policy_steps: 0"
            )
        if self.colocate and self.rollout_devices is not None:
            raise RecipeError(
                "cluster.rollout_devices applies to disaggregated placement; "
                "remove it or set cluster.colocate: false"
            )
        if not self.colocate:
            if self.devices < 2:
                raise RecipeError(
                    f"cluster.devices={self.devices}: disaggregated placement "
                    "needs >= 2 devices; raise it or set cluster.colocate: true"
                )
            if self.rollout_devices is not None and self.rollout_devices >= self.devices:
                raise RecipeError(
                    f"cluster.rollout_devices={self.rollout_devices} leaves no "
                    f"trainer device; use a value in [1, {self.devices - 1}]"
                )


@dataclass(frozen=True)
class RewardSection(Section):
    PATH = "reward"
    function: str = setting(
        "arith",
        "built-in (math | exact_match | arith | chain) or module:function "
        "with signature fn(prompt: str, response: str, answer: str) -> float",
    )
    max_workers: int = setting(8, "worker processes computing rewards concurrently", ge=1)
    timeout_s: float = setting(
        30.0,
        "seconds one reward call may take; past it the worker is "
        "killed and replaced and the sample scores 0",
        gt=0,
    )

    def check(self) -> None:
        from miles_like.scoring.rewards import check_spec  # rewards imports nothing from here

        check_spec(self.function)


@dataclass(frozen=True)
class TrackingSection(Section):
    PATH = "tracking"
    output_dir: str = setting("outputs/run", "metrics.jsonl, reward_curve.png, checkpoints")
    wandb_project: str | None = setting(None, "wandb project; null: no wandb")
    wandb_mode: Literal["offline", "online", "disabled"] = setting(
        "offline", "offline writes a local run directory (sync it later)"
    )


@dataclass(frozen=True)
class CheckpointSection(Section):
    PATH = "checkpoint"
    every_steps: int = setting(0, "save every this many steps; 0 disables checkpoints", ge=0)
    keep_last: int = setting(2, "checkpoints kept on disk", ge=1)
    resume: Literal[False, "auto"] | str = setting(
        False,
        "false: start fresh | auto: continue from the latest complete checkpoint in "
        "tracking.output_dir/checkpoints (fresh if there is none) | a checkpoint directory",
    )

    def check(self) -> None:
        if isinstance(self.resume, str) and not self.resume.strip():
            raise RecipeError(
                "checkpoint.resume: empty; use false, auto or the path of a "
                "checkpoint directory (tracking.output_dir/checkpoints/step_N)"
            )


@dataclass(frozen=True)
class Recipe(Section):
    model: ModelSection = setting(doc="the policy model")
    data: DataSection = setting(doc="the prompts")
    steps: int = setting(100, "RL steps", ge=1)
    seed: int = setting(0, "seed of sampling, initialization and synthetic data")
    sft: SFTSection = setting(default_factory=SFTSection)
    rollout: RolloutSection = setting(default_factory=RolloutSection)
    algorithm: AlgorithmSection = setting(default_factory=AlgorithmSection)
    trainer: TrainerSection = setting(default_factory=TrainerSection)
    cluster: ClusterSection = setting(default_factory=ClusterSection)
    reward: RewardSection = setting(default_factory=RewardSection)
    tracking: TrackingSection = setting(default_factory=TrackingSection)
    checkpoint: CheckpointSection = setting(default_factory=CheckpointSection)

    def check(self) -> None:
        """Rules that span sections, after the trainer / engine configs the recipe maps onto have
        accepted it (their errors name the recipe's fields)."""
        from miles_like.recipe.build_configs import check_configs  # it imports this module

        check_configs(self)
        alg, rollout = self.algorithm, self.rollout
        if alg.advantage in ("grpo", "dr_grpo", "rloo") and rollout.n < 2:
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
        if alg.kl_reward_coef > 0 and alg.advantage not in ("reinforce_pp", "gae"):
            raise RecipeError(
                f"algorithm.kl_reward_coef applies to reinforce_pp and gae, not "
                f"{alg.advantage}; use algorithm.kl_coef (KL as a loss term)"
            )
        if self.cluster.colocate and self.cluster.devices % (self.trainer.tp * self.trainer.pp):
            raise RecipeError(
                f"cluster.devices={self.cluster.devices} is not a multiple of "
                f"trainer.tp x trainer.pp = {self.trainer.tp * self.trainer.pp}; "
                "change one of them"
            )
        trainer_devices = (
            self.cluster.devices
            if self.cluster.colocate
            else self.cluster.devices - (self.cluster.rollout_devices or self.cluster.devices // 2)
        )
        if not self.cluster.colocate and trainer_devices % (self.trainer.tp * self.trainer.pp):
            raise RecipeError(
                f"cluster: {trainer_devices} trainer devices (cluster.devices - "
                "cluster.rollout_devices) is not a multiple of trainer.tp x "
                f"trainer.pp = {self.trainer.tp * self.trainer.pp}; change one"
            )
        engine_devices = (
            self.cluster.devices
            if self.cluster.colocate
            else (self.cluster.devices - trainer_devices)
        )
        if engine_devices % rollout.tp:
            raise RecipeError(
                f"rollout.tp={rollout.tp} must divide the {engine_devices} engine devices "
                "(cluster.devices, or cluster.rollout_devices when not colocated); change one"
            )
        samples = rollout.prompts_per_step * rollout.n
        if self.trainer.updates_per_rollout > samples:
            raise RecipeError(
                f"trainer.updates_per_rollout={self.trainer.updates_per_rollout} "
                f"exceeds the {samples} samples per step (rollout.prompts_per_step "
                "x rollout.n); lower it"
            )
        if alg.advantage == "gae" and self.trainer.backend != "megatron":
            raise RecipeError(
                "algorithm.advantage=gae trains a critic, which the megatron "
                "backend provides; set trainer.backend: megatron"
            )
        if (
            self.trainer.backend == "deepspeed"
            and self.trainer.zero_stage == 3
            and self.cluster.colocate
            and device_type(self.cluster.accelerator) == "cuda"
        ):
            raise RecipeError(
                "trainer.zero_stage=3: colocated on GPU the trainer must offload "
                "its state for the engine, which deepspeed's ZeRO-3 cannot do with "
                "torch's Adam; use trainer.zero_stage 1 or 2, or "
                "cluster.colocate: false"
            )
        if (
            self.checkpoint.every_steps
            and self.trainer.backend == "deepspeed"
            and self.trainer.zero_stage == 3
        ):
            raise RecipeError(
                "checkpoint.every_steps: checkpoints of the deepspeed backend "
                "need trainer.zero_stage 1 or 2; lower it or set "
                "checkpoint.every_steps: 0"
            )
        if rollout.function == "tool_loop" and not self.data.chat_template:
            raise RecipeError(
                "rollout.function=tool_loop renders tool calls and results with "
                "the chat template; set data.chat_template: true"
            )
        self._check_over_sampling()
        total = rollout.max_trajectory_tokens
        if total is not None and total < rollout.max_new_tokens:
            raise RecipeError(
                f"rollout.max_trajectory_tokens={total} is below "
                f"rollout.max_new_tokens={rollout.max_new_tokens} (one turn); "
                "raise it or lower rollout.max_new_tokens"
            )
        if total is not None and total >= self.trainer.max_tokens_per_micro_batch:
            raise RecipeError(
                f"rollout.max_trajectory_tokens={total} leaves no room for a "
                "prompt in trainer.max_tokens_per_micro_batch="
                f"{self.trainer.max_tokens_per_micro_batch}; raise the latter"
            )
        if rollout.max_new_tokens >= self.trainer.max_tokens_per_micro_batch:
            raise RecipeError(
                f"rollout.max_new_tokens={rollout.max_new_tokens} leaves no room for "
                "a prompt in trainer.max_tokens_per_micro_batch="
                f"{self.trainer.max_tokens_per_micro_batch}; raise the latter"
            )

    def _check_over_sampling(self) -> None:
        """rollout.over_sampling / partial / stream_scoring (`oversampling.py`)."""
        rollout = self.rollout
        over = rollout.over_sampling > 1
        if self.cluster.fully_async:
            self._check_fully_async()
            return
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
        if rollout.partial == "in_place" and self.cluster.colocate:
            raise RecipeError(
                "rollout.partial=in_place keeps KV across the weight update, but colocated "
                "engines release their KV for training; use rollout.partial: retract"
            )
        if rollout.max_carry_versions is not None and rollout.partial not in (
            "retract",
            "in_place",
        ):
            raise RecipeError(
                f"rollout.max_carry_versions={rollout.max_carry_versions} bounds carried "
                "groups, but rollout.partial is not retract or in_place; set one, or "
                "rollout.max_carry_versions: null"
            )
        if (over or rollout.stream_scoring) and rollout.function != "single_turn":
            field = "over_sampling" if over else "stream_scoring"
            raise RecipeError(
                f"rollout.{field} works with rollout.function: single_turn (a multi-turn "
                f"function's groups finish at controller-timed moments), not "
                f"{rollout.function!r}"
            )
        if (over or rollout.stream_scoring) and self.algorithm.dynamic_sampling:
            field = "over_sampling" if over else "stream_scoring"
            raise RecipeError(
                f"rollout.{field} and algorithm.dynamic_sampling both choose which groups a "
                "step trains on; use one of them"
            )

    def _check_fully_async(self) -> None:
        """cluster.fully_async (`async_rollouts.py`, `async_agents.py`): its own choice of
        which groups are trained (no over-sampling, streaming always on; dynamic sampling
        filters the buffer); multi-turn functions continue their calls after an update."""
        rollout, cluster = self.rollout, self.cluster
        if rollout.over_sampling > 1:
            raise RecipeError(
                "rollout.over_sampling: cluster.fully_async=true keeps the engines full by "
                "itself (cluster.async_buffer_groups); set rollout.over_sampling: 1"
            )
        if (
            rollout.partial == "in_place"
            and rollout.tp > 1
            and self.trainer.tp == rollout.tp
            and self.trainer.backend == "megatron"
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

    @property
    def async_buffer_groups(self) -> int:
        """cluster.async_buffer_groups resolved (its null default)."""
        c = self.cluster
        if c.async_buffer_groups is not None:
            return c.async_buffer_groups
        return self.rollout.prompts_per_step * (c.max_staleness + 1)


def device_type(accelerator: str) -> str:
    """What `cluster.accelerator` resolves to on this machine: "cuda" or "cpu"."""
    if accelerator == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return accelerator


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """`["rollout.n=4"]` -> `[("rollout.n", 4)]`; values are parsed as YAML scalars."""
    parsed = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key or any(not part for part in key.split(".")):
            raise RecipeError(f"override {item!r}: write dotted.key=value, e.g. rollout.n=4")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            raise RecipeError(f"override {item!r}: the value is not valid YAML; quote it") from None
        parsed.append((key, value))
    return parsed


def apply_overrides(
    data: Mapping[str, Any], overrides: Sequence[tuple[str, Any]]
) -> dict[str, Any]:
    """A copy of the recipe mapping with each dotted key set (sections created as needed)."""
    out = copy.deepcopy(dict(data))
    for key, value in overrides:
        node = out
        parts = key.split(".")
        for depth, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                where = ".".join(parts[: depth + 1])
                raise RecipeError(
                    f"override {key}: {where} is a value, not a section; "
                    f"override {where}=... instead"
                )
            node = child
        node[parts[-1]] = value
    return out


def check_paths(recipe: Recipe) -> None:
    """Local files the recipe names exist (and a user reward's module imports)."""
    if recipe.model.path is not None:
        p = Path(recipe.model.path).expanduser()
        if not p.is_dir():
            raise RecipeError(
                f"model.path={recipe.model.path!r}: no such directory; give a local "
                "Hugging Face model directory (or --no-path-check for a dry run)"
            )
        if not (p / "config.json").is_file():
            raise RecipeError(
                f"model.path={recipe.model.path!r} has no config.json; point it at "
                "a Hugging Face model directory"
            )
    draft = recipe.rollout.speculative_draft_model_path
    if draft is not None and not (Path(draft).expanduser() / "config.json").is_file():
        raise RecipeError(
            f"rollout.speculative_draft_model_path={draft!r}: no Hugging Face model directory "
            "(config.json) there; give the local directory of the draft model"
        )
    if recipe.data.path is not None and not Path(recipe.data.path).expanduser().is_file():
        raise RecipeError(
            f"data.path={recipe.data.path!r}: no such file; give a local .jsonl / "
            ".parquet file (or --no-path-check for a dry run)"
        )
    from miles_like.scoring.rewards import resolve_reward

    resolve_reward(recipe.reward.function)
    from miles_like.recipe.preflight import check_machine  # it imports nothing from here

    check_machine(recipe)
    from miles_like.rollouts.tools import load_tools

    load_tools(recipe.rollout.tools)
    if recipe.checkpoint.resume not in (False, "auto"):
        from miles_like.run.checkpoint import check_checkpoint_dir  # it imports nothing from here

        check_checkpoint_dir(Path(recipe.checkpoint.resume).expanduser(), "checkpoint.resume")


def recipe_from_dict(data: Mapping[str, Any]) -> Recipe:
    return from_dict(Recipe, data)


def load_recipe(
    path: str | Path, overrides: Sequence[str] = (), *, check_paths_exist: bool = True
) -> Recipe:
    """Read a recipe YAML, apply dotted `key=value` overrides, validate. One RecipeError line on
    any problem. `check_paths_exist=False` skips the filesystem (model / data paths, user reward
    modules): for checking a recipe on a machine that lacks them."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RecipeError(
            f"recipe {str(path)!r}: no such file; give the path of a recipe "
            "YAML, e.g. recipes/tiny_arith_grpo.yaml"
        ) from None
    except OSError as e:
        raise RecipeError(f"recipe {str(path)!r}: cannot read it ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or "syntax error"
        raise RecipeError(
            f"recipe {str(path)!r}: invalid YAML{where}: {problem}; fix the syntax"
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(
            f"recipe {str(path)!r}: the top level must be a mapping of sections "
            "(model:, data:, rollout:, ...)"
        )
    recipe = recipe_from_dict(apply_overrides(data, parse_overrides(overrides)))
    if check_paths_exist:
        check_paths(recipe)
    return recipe


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML; loading it again gives an equal recipe."""
    return yaml.safe_dump(to_plain(recipe), sort_keys=False, default_flow_style=False)
