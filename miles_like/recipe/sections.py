"""The recipe's sections: every field a run reads, with its type, default, range and help text
(`--help` and the documentation's field table are generated from these declarations).

Each section is a frozen, validated config (`config_schema`): a field's type and range are
checked when the section is built, then the section's `check` applies the rules between its own
fields. Rules across sections are in `rules.py`, the `Recipe` that holds the sections in
`recipe.py`. Every failure is one `RecipeError` line naming the dotted field and the fix.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from config_schema import Config, Namer, Renamed, config
from miles_like.errors import RecipeError
from miles_like.models.builtin import BUILTIN_MODELS
from miles_like.tasks.arith import ArithSpec
from miles_like.tasks.chain import ChainSpec

# calc: arith's problems, solved with the calculator tool; chain: chains of operations answered
# step by step (tasks/chain.py), long-tailed lengths
SYNTHETIC_TASKS = ("arith", "calc", "chain")
DATA_SUFFIXES = (".jsonl", ".json", ".parquet")


@config
class Section(Config):
    """Base of the recipe's sections: errors are `RecipeError`s naming `PREFIX.field` (the
    section's dotted path), and a renamed field warns the user (`FutureWarning`)."""

    ERROR = RecipeError
    DEPRECATION = FutureWarning


@config
class ModelSection(Section):
    PREFIX = "model"
    path: str | None = Field(
        None,
        description="local Hugging Face model directory (config.json, "
        "*.safetensors, tokenizer files); set this or builtin",
    )
    builtin: str | None = Field(
        None,
        description=f"built-in tiny model with the character tokenizer: "
        f"{' | '.join(BUILTIN_MODELS)}; set this or path",
    )
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32",
        description="compute dtype of trainer and engine; float64 (megatron backend) keeps the "
        "engine-vs-trainer log-prob gap within 1e-10 (tested) for tiny CPU models",
    )

    def check(self, name: Namer) -> None:
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


@config
class DataSection(Section):
    PREFIX = "data"
    path: str | None = Field(
        None,
        description="local .jsonl / .json / .parquet file read with HF datasets; set this or "
        "synthetic",
    )
    synthetic: str | None = Field(
        None,
        description="task generated on the fly: arith | calc (arith's "
        "problems; the warm start demonstrates the calculator tool "
        "when rollout.tools has it) | chain (chains of operations "
        "answered step by step: long-tailed lengths); set this or path",
    )
    prompt_key: str = Field("prompt", description="column holding the prompt text")
    answer_key: str = Field(
        "answer", description="column holding the reference answer given to the reward"
    )
    chat_template: bool = Field(True, description="wrap prompts in the tokenizer's chat template")
    shuffle_seed: int | None = Field(
        0, description="seed of the epoch shuffle; null keeps file order"
    )
    arith_digits: int = Field(
        2, description="synthetic arith / calc: operands have up to this many digits", ge=1, le=9
    )
    arith_ops: str = Field(
        "+-", description="synthetic arith / calc: operators to draw from (subset of +-*)"
    )
    chain_max_ops: int = Field(
        12, description="synthetic chain: at most this many operations per prompt", ge=1, le=64
    )
    chain_continue_p: float = Field(
        0.6,
        description="synthetic chain: probability of one more operation after each (geometric "
        "lengths, mean 1 / (1 - p), capped by chain_max_ops)",
        ge=0.0,
        lt=1.0,
    )
    chain_ops: str = Field(
        "+-", description="synthetic chain: operators to draw from (subset of +-*)"
    )
    chain_max_value: int = Field(
        99,
        description="synthetic chain: running values stay in [0, this] (9: one digit each)",
        ge=9,
        le=9999,
    )

    def check(self, name: Namer) -> None:
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


@config
class RolloutSection(Section):
    PREFIX = "rollout"
    SUGGEST = {
        "group_size": "n",
        "n_samples_per_prompt": "n",
        "batch_size": "prompts_per_step",
        "rollout_batch_size": "prompts_per_step",
        "max_tokens": "max_new_tokens",
        "max_response_length": "max_new_tokens",
    }
    prompts_per_step: int = Field(32, description="prompts drawn per RL step", ge=1)
    n: int = Field(8, description="samples per prompt (the group size)", ge=1)
    temperature: float = Field(1.0, description="sampling temperature (> 0: RL samples)", gt=0.0)
    top_p: float = Field(1.0, description="nucleus sampling mass, in (0, 1]")
    top_k: int = Field(-1, description="top-k sampling; -1 disables it")
    max_new_tokens: int = Field(64, description="longest response in tokens")
    ignore_eos: bool = Field(
        False,
        description="sample exactly max_new_tokens tokens, past the EOS (fixed-length workloads, "
        "e.g. benchmarks); false stops at the EOS",
    )
    kv_cache_tokens: int | None = Field(
        None,
        description="engine KV pool size in tokens; null: rollout.kv_memory_fraction of the "
        "device's free memory",
    )
    kv_memory_fraction: float = Field(
        0.2,
        description="kv_cache_tokens null: the share, in (0, 1], of the device's free memory the "
        "engine's KV pool takes, measured when the pool is allocated (colocated: after the "
        "trainer has offloaded and the weights are pushed, at every step)",
        gt=0.0,
        le=1.0,
    )
    kv_cache_dtype: Literal["auto", "fp8_e4m3"] = Field(
        "auto",
        description="how the engine's KV pool stores K/V: auto (model.dtype) | fp8_e4m3 (half "
        "of bfloat16's bytes per token; per-(layer, KV head) scales calibrated from the weights "
        "at every weight update; not with model.dtype float64)",
    )
    page_size: int = Field(16, description="engine KV page size in tokens (prefix-sharing unit)")
    max_running_requests: int = Field(256, description="most sequences the engine decodes at once")
    speculative_method: Literal["ngram", "group", "draft"] | None = Field(
        None, description="exact speculative decoding: ngram | group | draft | null (off)"
    )
    num_speculative_tokens: int = Field(4, description="tokens drafted per speculative step", ge=1)
    speculative_draft_model_path: str | None = Field(
        None,
        description="speculative_method=draft: local HF directory of a smaller model with the "
        "policy's vocabulary (its weights are not updated)",
    )
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto",
        description="engine attention: torch (every device) | triton (CUDA kernels; not for "
        "float64) | auto (triton on CUDA with rollout.tp 1 below float64, else torch)",
    )
    decode_graphs: bool | None = Field(
        None,
        description="pure decode steps at static shapes, captured as CUDA graphs on a GPU; null: "
        "on with the triton backend on CUDA",
    )
    compile: bool = Field(
        False,
        description="torch.compile the engine's forward outside attention (fused norm / rotary / "
        "MLP loops; compiles in the first steps; rounds differently from eager, so off for exact "
        "float64 runs); not with rollout.tp > 1",
    )
    quantization: Literal["fp8"] | None = Field(
        None,
        description="fp8: the engine holds its linear weights (attention, MLP, experts) as "
        "block-wise FP8 (128x128 float8_e4m3fn, float32 scales), quantized by the weight sync's "
        "sender (about half the bytes of bf16 per push); the trainer stays in model.dtype, so "
        "algorithm.is_correction (tis | mis) is required; null: the model dtype",
    )
    tp: int = Field(
        1,
        description="engine tensor-parallel size: devices per engine replica (k Ray actors, one "
        "scheduler on rank 0); must divide the model's attention and KV heads",
        ge=1,
    )
    function: str = Field(
        "single_turn",
        description="rollout function: built-in single_turn | tool_loop, or module:function, "
        "an async fn(ctx, problem) -> list[Trajectory] returning the prompt's n trajectories "
        "(docs/agents.md)",
    )
    max_turns: int = Field(
        1,
        description="most model turns per trajectory a multi-turn rollout function takes "
        "(ctx.max_turns)",
        ge=1,
    )
    tools: tuple[str, ...] = Field(
        (),
        description="module:function tools a multi-turn rollout function "
        "may call (ctx.tools): plain Python functions (schema from "
        "the annotations and docstring), each call run in a worker "
        "process (ctx.tool_pool)",
    )
    tool_timeout_s: float = Field(
        10.0,
        description="longest a tool call may run; past it the worker is "
        "killed and the model gets an error result",
        gt=0.0,
    )
    tool_output_max_chars: int = Field(
        2000,
        description="longest tool output; a longer one is refused "
        "with an error result (never truncated silently)",
        ge=1,
    )
    tool_workers: int = Field(2, description="worker processes running tool calls", ge=1)
    tool_schemas_in_prompt: bool = Field(
        True,
        description="tool_loop: the chat template shows the "
        "tools' schemas in a system turn (false: the model "
        "knows its tools from training, a shorter prompt)",
    )
    max_trajectory_tokens: int | None = Field(
        None,
        description="tool_loop: most tokens after the prompt in a trajectory (sampled turns, tool "
        "results, template markers); null: what the context leaves",
        ge=1,
    )
    serve_http: bool = Field(
        False,
        description="serve the engines as an OpenAI-compatible endpoint on "
        "127.0.0.1 behind a cache-aware router during rollouts "
        "(ctx.base_url, for agent code)",
    )
    http_host: str = Field(
        "127.0.0.1",
        description="rollout.serve_http: the address the router binds; anything but loopback "
        "needs rollout.api_key",
    )
    api_key: str | None = Field(
        None,
        description="rollout.serve_http: every request but /health must send 'Authorization: "
        "Bearer <key>'; null: none (the router then binds loopback only)",
    )
    over_sampling: float = Field(
        1.0,
        description="launch ceil(prompts_per_step x this) groups a step; the first "
        "prompts_per_step to complete are the batch, the rest go by rollout.partial (single_turn "
        "only)",
        ge=1.0,
    )
    partial: Literal["abort", "retract", "in_place"] | None = Field(
        None,
        description="over_sampling > 1: the unfinished groups are dropped (abort) or continue "
        "next step under the new weights, tokens kept, KV prefilled again (retract) or kept in "
        "the engine across the weight update (in_place, disaggregated only); cluster.fully_async: "
        "what an update does to running requests: abort, retract (null) or in_place (kept running "
        "on their K/V)",
    )
    max_carry_versions: int | None = Field(
        None,
        description="partial retract / in_place: a group is carried across at most this many "
        "weight updates, then dropped (counted); null: no bound",
        ge=0,
    )
    stream_scoring: bool = Field(
        False,
        description="score each group as soon as its n samples finish, overlapping generation "
        "(single_turn only; always on with over_sampling > 1)",
    )
    prefill_replicas: int = Field(
        0,
        description="prefill-decode disaggregation: this many of the engine replicas only "
        "prefill (prompt K/V and first tokens, handed to the others, which decode); 0: off, "
        "every replica does both. With rollout.tp every replica, prefill or decode, has "
        "rollout.tp ranks; with partial: in_place a carried sample continues on the decode "
        "replica that parked its K/V; with cluster.fully_async (single-turn) the producer's "
        "requests are prefilled on the prefill replicas and decoded on the others",
        ge=0,
    )
    pd_local_prefill_tokens: int = Field(
        256,
        description="prefill-decode: a session's later turn whose part not yet in its decode "
        "replica's prefix cache is at most this many tokens is prefilled on that decode replica "
        "(reusing the earlier turns' K/V it holds, completions included) instead of a prefill "
        "replica; first turns always go through a prefill replica; 0: every request does. The "
        "batch rollouts only (not the HTTP endpoint or over-sampled streams)",
        ge=0,
    )

    def check(self, name: Namer) -> None:
        from miles_like.rollouts.functions import check_rollout_spec  # imports nothing from here
        from miles_like.rollouts.tools import check_spec  # tools imports nothing from here
        from rollout.serving.auth import check_bind  # imports nothing from here

        check_rollout_spec(self.function)
        for i, spec in enumerate(self.tools):
            check_spec(spec, f"rollout.tools[{i}]")
        check_bind(self.http_host, self.api_key, name("api_key"))


def _gspo_as_policy_loss(on: object) -> str:
    """`algorithm.gspo` (a bool, the former spelling) as `algorithm.policy_loss`."""
    if not isinstance(on, bool):
        raise ValueError("expected true or false; or write policy_loss: ppo | gspo instead")
    return "gspo" if on else "ppo"


@config
class AlgorithmSection(Section):
    PREFIX = "algorithm"
    RENAMED = {"gspo": Renamed("policy_loss", _gspo_as_policy_loss)}
    SUGGEST = {
        "advantage_estimator": "advantage",
        "eps_clip": "clip_low",
        "eps_clip_high": "clip_high",
        "kl_loss_coef": "kl_coef",
        "kl_loss_type": "kl_type",
        "loss_agg_mode": "loss_agg",
    }
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"] = Field(
        "grpo", description="advantage estimator (gae trains a critic: PPO)"
    )
    clip_low: float = Field(0.2, description="PPO ratio clip below: 1 - clip_low", ge=0.0)
    clip_high: float = Field(
        0.2,
        description="PPO ratio clip above: 1 + clip_high (> clip_low: DAPO's clip-higher)",
        ge=0.0,
    )
    dual_clip: float | None = Field(
        None,
        description="dual-clip constant c > 1 for negative advantages; null disables it",
        gt=1.0,
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: a clipped ratio per token | gspo: one ratio per sequence (GSPO; use a "
        "far smaller clip range, e.g. 3e-4 / 4e-4)",
    )
    loss_agg: str = Field(
        "token-mean", description="loss aggregation: token-mean | seq-mean | seq-mean-token-sum"
    )
    kl_coef: float = Field(
        0.0, description="KL-to-reference loss coefficient (> 0 keeps a reference model)", ge=0.0
    )
    kl_type: str = Field("low-var-kl", description="KL estimator: k1 | k2 | k3 | low-var-kl")
    kl_reward_coef: float = Field(
        0.0,
        description="per-token KL penalty folded into the reward "
        "(reinforce_pp, gae); > 0 keeps a reference model",
        ge=0.0,
    )
    entropy_coef: float = Field(0.0, description="entropy bonus coefficient", ge=0.0)
    gamma: float = Field(1.0, description="discount (reinforce_pp, gae)", ge=0.0, le=1.0)
    gae_lambda: float = Field(1.0, description="GAE lambda (gae)", ge=0.0, le=1.0)
    value_clip: float | None = Field(
        0.2, description="critic value clip (gae); null disables it", gt=0.0
    )
    dynamic_sampling: bool = Field(
        False,
        description="drop groups whose rewards are all equal and oversample prompts to refill the "
        "batch (DAPO); cluster.fully_async: filtered from the buffer as they are scored",
    )
    dynamic_sampling_max_rounds: int = Field(
        4,
        description="most extra generation rounds to refill a batch before training on what there "
        "is (fully_async: at most this x prompts_per_step groups filtered per batch)",
        ge=1,
    )
    overlong_buffer: int = Field(
        0,
        description="DAPO soft overlong penalty: responses longer than "
        "max_new_tokens - buffer lose reward linearly; 0 disables it",
        ge=0,
    )
    overlong_penalty: float = Field(
        1.0, description="reward lost at max_new_tokens (the penalty factor)", ge=0.0
    )
    is_correction: Literal["tis", "mis"] | None = Field(
        None, description="engine-vs-trainer importance correction: tis | mis | null"
    )
    is_cap: float = Field(2.0, description="tis / mis: cap of the importance weight", gt=0.0)
    # YAML reads a bare `off` as false: both mean off
    routing_replay: Literal["off", "rollout", False] | None = Field(
        None,
        description="mixture of experts: rollout: the trainer routes each token to the experts "
        "the engine routed it to (R3) | off (false): the trainer's router picks them; null: "
        "rollout for a mixture of experts, else off",
    )


@config
class TrainerSection(Section):
    PREFIX = "trainer"
    SUGGEST = {
        "learning_rate": "lr",
        "tensor_model_parallel_size": "tp",
        "pipeline_model_parallel_size": "pp",
        "micro_batch_tokens": "max_tokens_per_micro_batch",
    }
    backend: str = Field("megatron", description="megatron | deepspeed")
    tp: int = Field(1, description="tensor-parallel size", ge=1)
    pp: int = Field(1, description="pipeline-parallel size", ge=1)
    lr: float = Field(1e-6, description="peak learning rate", gt=0.0)
    min_lr: float = Field(0.0, description="cosine schedule: final learning rate", ge=0.0)
    lr_schedule: str = Field(
        "constant",
        description="constant | cosine (decays over steps x updates_per_rollout optimizer steps)",
    )
    warmup_steps: int = Field(0, description="linear warmup, in optimizer steps")
    weight_decay: float = Field(0.0, description="AdamW weight decay (not on 1-D params)", ge=0.0)
    grad_clip: float | None = Field(
        1.0, description="max global grad norm; null disables clipping", gt=0.0
    )
    max_tokens_per_micro_batch: int = Field(4096, description="packed tokens per micro-batch")
    updates_per_rollout: int = Field(
        1, description="optimizer steps per rollout batch (mini-batches)", ge=1
    )
    zero_stage: int = Field(2, description="deepspeed backend: ZeRO stage", ge=1, le=3)
    critic_lr: float = Field(1e-5, description="gae: critic learning rate", gt=0.0)
    compile: bool = Field(
        False,
        description="megatron backend: torch.compile the element-wise pieces (RMSNorm, rotary, "
        "SwiGLU; compiles in the first step; rounds differently from eager, so off for exact "
        "float64 runs)",
    )
    share_prompts: bool = Field(
        True,
        description="megatron backend: a prompt shared by samples of a micro-batch (a GRPO group) "
        "is computed once, its responses attending to it as in their own sequences (the same "
        "function; float32 rounds differently)",
    )
    distributed_optimizer: bool | None = Field(
        None,
        description="megatron backend: true: the fp32 masters and Adam moments sharded over "
        "data-parallel ranks (megatron's DistributedOptimizer: 1/DP of that memory each, the "
        "same update); false: whole on every rank; null: true with CUDA, DP > 1 and float32 / "
        "bfloat16",
    )
    moe_aux_loss_coeff: float = Field(
        0.0,
        description="megatron backend, a mixture of experts: coefficient of the switch "
        "load-balancing loss (megatron's moe_aux_loss_coeff), logged as train/moe_aux_loss when "
        "> 0; 0 disables it",
        ge=0.0,
    )


@config
class SFTSection(Section):
    PREFIX = "sft"
    steps: int = Field(
        0,
        description="supervised warm start: optimizer steps on (prompt, answer) pairs of "
        "the data before RL; 0 skips it",
        ge=0,
    )
    batch_size: int = Field(64, description="pairs per warm-start step", ge=1)
    lr: float = Field(1e-3, description="warm-start learning rate (constant)", gt=0.0)
    stop_loss: float | None = Field(
        None,
        description="stop the warm start at the first step where the mean loss of the last "
        "sft.stop_window steps is below this (sft.steps is then the most it runs); "
        "null: always sft.steps",
        gt=0.0,
    )
    stop_window: int = Field(5, description="steps the sft.stop_loss mean is taken over", ge=1)
    cache: bool = Field(
        True,
        description="reuse a finished warm start with the same model, data, settings "
        "and seed from $MILES_LIKE_CACHE (default ~/.cache/miles_like)",
    )


@config
class ClusterSection(Section):
    PREFIX = "cluster"
    # `async` is a Python keyword, so the field is fully_async (verl's name for the mode)
    SUGGEST = {"async": "fully_async"}
    devices: int = Field(
        1, description="devices (GPUs; CPU slots without CUDA) in the placement group", ge=1
    )
    accelerator: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when available"
    )
    colocate: bool = Field(
        True, description="trainer rank i and engine i share device i; phases alternate"
    )
    rollout_devices: int | None = Field(
        None,
        description="disaggregated only: devices for engines (the rest train); null: half",
        ge=1,
    )
    off_policy_steps: Literal[0, 1] = Field(
        0, description="1: rollout k+1 overlaps training k (disaggregated only)"
    )
    fully_async: bool = Field(
        False,
        description="disaggregated only: engines generate without stopping into a bounded buffer; "
        "the trainer takes a batch when one is ready; weights reach the engines between their "
        "steps (running requests continue by rollout.partial, null: retract; a multi-turn "
        "function's engine calls continue from their tokens)",
    )
    max_staleness: int = Field(
        1,
        description="fully_async: a group is trained at most this many weight versions after its "
        "oldest token was sampled, else dropped (counted); 0 reproduces the synchronous run",
        ge=0,
    )
    take_ahead: bool = Field(
        True,
        description="fully_async, max_staleness >= 1: take the next step's batch while the "
        "trainer trains, so that the next train call starts right after the weight update (not in "
        "a step that checkpoints); false: take it after the update",
    )
    async_buffer_groups: int | None = Field(
        None,
        description="fully_async: groups generating, waiting or being trained at once "
        "(back-pressure); null: rollout.prompts_per_step x (max_staleness + 1)",
        ge=1,
    )
    address: str | None = Field(
        None,
        description="Ray cluster address (e.g. auto, ray://host:10001); null starts a local Ray",
    )
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="Ray placement-group strategy for the device bundles: PACK fills a node before "
        "the next; SPREAD deals bundles across nodes (bundle i = trainer rank / engine i)",
    )
    cpu_threads: int | None = Field(
        None,
        description="torch CPU threads per trainer rank / engine; null: CPU cores // devices, at "
        "most $OMP_NUM_THREADS where it is set. 1 on a shared machine: a multi-threaded step "
        "whose threads wait for one another slows down many times when other processes hold the "
        "cores",
        ge=1,
    )
    pin_cpus: bool = Field(
        False,
        description="disaggregated on CPU: pin each worker process to its own cpu_threads cores "
        "(bundle b: the b-th run of cpu_threads cores the controller may use), so the trainer and "
        "the engines do not migrate across the same cores; devices x cpu_threads must fit them",
    )
    call_timeout_s: float = Field(
        1800.0,
        description="longest wait for one actor call (a rollout, a train "
        "step, a weight sync, a checkpoint) and for the weight-sync "
        "collectives; past it the run stops, naming the call",
        gt=0.0,
    )
    max_engine_restarts: int = Field(
        3,
        description="engine replicas replaced in place over a run when one dies generating "
        "(either loop); a death past this many stops the run (0: the first one does)",
        ge=0,
    )

    def device_type(self) -> str:
        """What `accelerator` resolves to on this machine: "cuda" or "cpu"."""
        if self.accelerator == "auto":
            import torch

            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.accelerator

    def check(self, name: Namer) -> None:
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


@config
class RewardSection(Section):
    PREFIX = "reward"
    function: str = Field(
        "arith",
        description="built-in (math | exact_match | arith | chain) or module:function "
        "with signature fn(prompt: str, response: str, answer: str) -> float",
    )
    max_workers: int = Field(8, description="worker processes computing rewards concurrently", ge=1)
    timeout_s: float = Field(
        30.0,
        description="seconds one reward call may take; past it the worker is "
        "killed and replaced and the sample scores 0",
        gt=0,
    )

    def check(self, name: Namer) -> None:
        from miles_like.scoring.rewards import check_spec  # rewards imports nothing from here

        check_spec(self.function)


@config
class TrackingSection(Section):
    PREFIX = "tracking"
    output_dir: str = Field(
        "outputs/run", description="metrics.jsonl, reward_curve.png, checkpoints"
    )
    wandb_project: str | None = Field(None, description="wandb project; null: no wandb")
    wandb_mode: Literal["offline", "online", "disabled"] = Field(
        "offline", description="offline writes a local run directory (sync it later)"
    )


@config
class CheckpointSection(Section):
    PREFIX = "checkpoint"
    every_steps: int = Field(
        0, description="save every this many steps; 0 disables checkpoints", ge=0
    )
    keep_last: int = Field(2, description="checkpoints kept on disk", ge=1)
    resume: Literal[False, "auto"] | str = Field(
        False,
        description="false: start fresh | auto: continue from the latest complete checkpoint in "
        "tracking.output_dir/checkpoints (fresh if there is none) | a checkpoint directory",
    )

    def check(self, name: Namer) -> None:
        if isinstance(self.resume, str) and not self.resume.strip():
            raise RecipeError(
                "checkpoint.resume: empty; use false, auto or the path of a "
                "checkpoint directory (tracking.output_dir/checkpoints/step_N)"
            )
