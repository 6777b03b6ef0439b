"""Trainer configuration (`TrainerConfig`, with its `OptimConfig` and `LossConfig`) and the batch
it trains on (`RLBatch`).

The configs are frozen configs (`config_schema`): each field's type, range and choices are
declared with it and checked on construction, the rules between fields in `check`; a bad value
raises one `ConfigError` line (a `ValueError`) naming the field and the fix. Their fields have
the recipe's names (`tp`, `kl_type`, `loss_agg`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

import torch
from pydantic import Field

from config_schema import Config, Namer, Renamed, config
from trainer.losses import KLType, LossAgg
from trainer.tensor_lists import pack, unpack


@config
class OptimConfig(Config):
    lr: float = Field(1e-6, ge=0.0)
    min_lr: float = Field(0.0, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    grad_clip: float | None = Field(1.0, gt=0.0)
    """Max global grad norm; None disables clipping."""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    total_steps: int = Field(1000, ge=1)
    """Cosine decays from lr to min_lr at this step."""


@config
class LossConfig(Config):
    RENAMED = {"kl_kind": Renamed("kl_type"), "agg_mode": Renamed("loss_agg")}
    policy_loss: Literal["ppo", "gspo", "sft"] = "ppo"
    """ppo: a clipped ratio per token; gspo: one ratio per sequence; sft: the negative
    log-likelihood of the response tokens (a warm start)."""
    clip_low: float = Field(0.2, ge=0.0)
    """PPO ratio clip range [1 - clip_low, 1 + clip_high]; clip_high > clip_low is DAPO's
    clip-higher. GSPO's sequence ratios need a far smaller range (the paper: 3e-4 / 4e-4)."""
    clip_high: float = Field(0.2, ge=0.0)
    dual_clip: float | None = Field(None, gt=1.0)
    """e.g. 3.0: the loss of a negative advantage is bounded by dual_clip x |advantage|."""
    loss_agg: LossAgg = "token-mean"
    kl_coef: float = Field(0.0, ge=0.0)
    """KL to the reference model as a loss term."""
    kl_type: KLType = "low-var-kl"
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus (subtracted from the loss)."""
    is_correction: Literal["tis", "mis"] | None = None
    """Engine-vs-trainer importance correction."""
    is_cap: float = Field(2.0, gt=0.0)
    is_floor: float = Field(0.0, ge=0.0)
    """mis only: drop tokens with weight below this."""
    temperature: float = Field(1.0, gt=0.0)
    """Log-probs are of logits / temperature (match sampling)."""


@config
class TrainerConfig(Config):
    RENAMED = {
        "tensor_model_parallel_size": Renamed("tp"),
        "pipeline_model_parallel_size": Renamed("pp"),
    }
    model_path: str
    backend: Literal["megatron", "deepspeed"] = "megatron"
    tp: int = Field(1, ge=1)
    """Tensor-parallel size (megatron)."""
    pp: int = Field(1, ge=1)
    """Pipeline-parallel size (megatron)."""
    max_tokens_per_micro_batch: int = Field(4096, ge=1)
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    optim: OptimConfig = Field(default_factory=OptimConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    use_reference: bool = False
    """Keep a frozen copy for KL (needed when kl_coef > 0)."""
    reference_path: str | None = None
    """The reference's HF directory; None: model_path."""
    reference_on_cpu: bool = False
    """Reference weights live in host memory between uses."""
    zero_stage: int = Field(2, ge=1, le=3)
    """deepspeed backend only."""
    vocab_pad_multiple: int = Field(128, ge=1)
    """megatron pads the vocab to a multiple of this x TP."""
    use_transformer_engine: bool = False
    """megatron backend on GPU: Transformer Engine layer specs instead of the local spec + SDPA
    attention (both compute the same function; TE is faster). Untested in CI (no GPU)."""
    compile: bool = False
    """megatron backend: torch.compile the element-wise pieces (RMSNorm, SwiGLU; `compiled`)."""
    share_prompts: bool = True
    """megatron backend: a prompt shared by samples of a micro-batch (a GRPO group) is computed
    once, its responses attending to it as in their own sequences (`packing`)."""
    distributed_optimizer: bool | None = None
    """megatron backend: the fp32 masters and Adam moments sharded over data-parallel ranks
    (true: megatron's DistributedOptimizer) or held whole on each (false: torch AdamW); None:
    sharded on CUDA with more than one DP rank (`megatron_optimizer`). A bool, not on / off:
    YAML reads those as booleans."""
    moe_aux_loss_coeff: float = Field(0.0, ge=0.0)
    """megatron backend, a mixture of experts: coefficient of the switch load-balancing loss
    (megatron's `moe_aux_loss_coeff`; `megatron_moe`); its value is reported as `moe_aux_loss`
    when > 0. 0 disables it."""

    def check(self, name: Namer) -> None:
        if self.dtype == "float64" and self.backend != "megatron":
            raise ValueError(
                f"{name('dtype')}='float64' runs on {name('backend')}='megatron' only; "
                "use float32 with deepspeed"
            )
        if self.compile and self.backend != "megatron":
            raise ValueError(
                f"{name('compile')}=true runs on {name('backend')}='megatron' only; set it to false"
            )
        if self.distributed_optimizer and (self.backend != "megatron" or self.dtype == "float64"):
            raise ValueError(
                f"{name('distributed_optimizer')}=true needs {name('backend')}='megatron' with "
                f"{name('dtype')} float32 or bfloat16 (deepspeed shards with zero_stage; "
                "megatron's distributed optimizer takes no float64); set it to false or null"
            )
        if self.moe_aux_loss_coeff > 0 and self.backend != "megatron":
            raise ValueError(
                f"{name('moe_aux_loss_coeff')} > 0 runs on {name('backend')}='megatron' only; "
                "set it to 0 with deepspeed"
            )
        if self.loss.kl_coef > 0 and not self.use_reference:
            raise ValueError(
                f"{name('loss')}.kl_coef > 0 needs a reference model: set "
                f"{name('use_reference')}: true"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[
            self.dtype
        ]


@dataclass(frozen=True)
class RLBatch:
    """Samples to train on. Sample i is `tokens[i]` = prompt + response, the response starting at
    `prompt_lens[i]`; per-response-token tensors have length len(tokens[i]) - prompt_lens[i].

    Every trainer rank receives the whole batch and takes its data-parallel share itself, so the
    loss normalizers (token / sequence counts) are global without communication."""

    tokens: list[list[int]]
    prompt_lens: list[int]
    advantages: list[torch.Tensor] | None = None  # per response token
    rollout_logprobs: list[torch.Tensor] | None = None  # the engine's, for TIS / MIS
    old_logprobs: list[torch.Tensor] | None = None  # recomputed by the trainer when None
    ref_logprobs: list[torch.Tensor] | None = None  # computed from the reference when None
    loss_masks: list[torch.Tensor] | None = None  # per response token; default all ones
    returns: list[torch.Tensor] | None = None  # critic targets (PPO / GAE)
    old_values: list[torch.Tensor] | None = None  # critic values before the update
    # a mixture's routes to replay (`trainer.routing_replay`): per sample
    # [tokens - 1 or tokens, sparse layers, k] expert ids, row q the token at position q; None
    # for a sample another data-parallel rank trains on (each rank gets only its own samples')
    routed_experts: list[torch.Tensor] | None = None

    _PER_TOKEN = (
        "advantages",
        "rollout_logprobs",
        "old_logprobs",
        "ref_logprobs",
        "loss_masks",
        "returns",
        "old_values",
    )

    def __post_init__(self):
        if len(self.tokens) != len(self.prompt_lens):
            raise ValueError(
                f"batch has {len(self.tokens)} token lists but {len(self.prompt_lens)} prompt_lens"
            )
        for name in self._PER_TOKEN:
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != len(self.tokens):
                raise ValueError(
                    f"batch.{name} has {len(values)} entries for {len(self.tokens)} samples"
                )
            for i, v in enumerate(values):
                want = len(self.tokens[i]) - self.prompt_lens[i]
                if v.numel() != want:
                    raise ValueError(
                        f"batch.{name}[{i}] has {v.numel()} values; sample {i} has "
                        f"{want} response tokens"
                    )
        if self.routed_experts is not None:
            _check_routes(self.routed_experts, self.tokens)

    def response_len(self, i: int) -> int:
        return len(self.tokens[i]) - self.prompt_lens[i]

    def subset(self, idx: list[int]) -> RLBatch:
        """The samples `idx`, in that order (a data-parallel rank's share)."""

        def pick(values):
            return None if values is None else [values[i] for i in idx]

        return RLBatch(
            tokens=pick(self.tokens),
            prompt_lens=pick(self.prompt_lens),
            routed_experts=pick(self.routed_experts),
            **{name: pick(getattr(self, name)) for name in self._PER_TOKEN},
        )

    def __reduce__(self):
        # each per-token field as one flat tensor: pickling hundreds of small tensors one by
        # one is most of a Ray call's cost (`trainer.tensor_lists`); every field travels
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return _unpickle_batch, (values | {k: pack(values[k]) for k in self._PER_TOKEN},)


def _check_routes(routes, tokens) -> None:
    """One line naming the sample whose routes do not fit its tokens."""
    if len(routes) != len(tokens):
        raise ValueError(
            f"batch.routed_experts has {len(routes)} entries for {len(tokens)} samples"
        )
    for i, r in enumerate(routes):
        if r is None:  # another rank's sample
            continue
        n = len(tokens[i])
        if r.dim() != 3 or r.shape[0] not in (n - 1, n):
            raise ValueError(
                f"batch.routed_experts[{i}] has shape {tuple(r.shape)}; sample {i} has {n} "
                f"tokens: want [{n - 1} or {n}, sparse layers, k]"
            )


def _unpickle_batch(values: dict) -> RLBatch:
    return RLBatch(**{k: unpack(v) for k, v in values.items()})
