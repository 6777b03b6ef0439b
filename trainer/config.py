"""Trainer configuration (the `trainer:` section of a recipe) and the batch it trains on."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Literal

import torch

from trainer.losses import AGG_MODES, KL_KINDS
from trainer.tensor_lists import pack, unpack


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    grad_clip: float | None = 1.0  # max global grad norm; None disables clipping
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = 0
    total_steps: int = 1000  # cosine decays from lr to min_lr at this step

    def __post_init__(self):
        if self.lr_schedule not in ("constant", "cosine"):
            raise ValueError(
                f"trainer.optim.lr_schedule={self.lr_schedule!r}; use 'constant' or 'cosine'"
            )
        if self.warmup_steps < 0 or self.total_steps < 1:
            raise ValueError("trainer.optim.warmup_steps must be >= 0 and total_steps >= 1")


@dataclass(frozen=True)
class LossConfig:
    policy_loss: Literal["ppo", "gspo", "sft"] = "ppo"
    # PPO ratio clip range [1 - clip_low, 1 + clip_high]; > clip_low is DAPO's clip-higher.
    # GSPO's sequence ratios need a far smaller range (the paper uses 3e-4 / 4e-4).
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None  # e.g. 3.0
    agg_mode: str = "token-mean"  # token-mean | seq-mean | seq-mean-token-sum
    kl_coef: float = 0.0  # KL to the reference model as a loss term
    kl_kind: str = "low-var-kl"  # k1 | k2 | k3 | low-var-kl
    entropy_coef: float = 0.0  # entropy bonus (subtracted from the loss)
    is_correction: Literal["tis", "mis"] | None = None  # engine-vs-trainer importance correction
    is_cap: float = 2.0
    is_floor: float = 0.0  # mis only: drop tokens with weight below this
    temperature: float = 1.0  # logprobs are of logits / temperature (match sampling)

    def __post_init__(self):
        if self.policy_loss not in ("ppo", "gspo", "sft"):
            raise ValueError(f"trainer.loss.policy_loss={self.policy_loss!r}; use ppo, gspo or sft")
        if self.agg_mode not in AGG_MODES:
            raise ValueError(f"trainer.loss.agg_mode={self.agg_mode!r}; use one of {AGG_MODES}")
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"trainer.loss.kl_kind={self.kl_kind!r}; use one of {KL_KINDS}")
        if self.is_correction not in (None, "tis", "mis"):
            raise ValueError(
                f"trainer.loss.is_correction={self.is_correction!r}; use tis, mis or null"
            )
        if self.temperature <= 0:
            raise ValueError(f"trainer.loss.temperature={self.temperature} must be > 0")


@dataclass(frozen=True)
class TrainerConfig:
    model_path: str
    backend: Literal["megatron", "deepspeed"] = "megatron"
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    max_tokens_per_micro_batch: int = 4096
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    use_reference: bool = False  # keep a frozen copy for KL (needed when kl_coef > 0)
    reference_path: str | None = None  # the reference's HF directory; None: model_path
    reference_on_cpu: bool = False  # reference weights live in host memory between uses
    zero_stage: int = 2  # deepspeed backend only
    vocab_pad_multiple: int = 128  # megatron pads the vocab to a multiple of this x TP
    # megatron backend on GPU: Transformer Engine layer specs instead of the local spec + SDPA
    # attention (both compute the same function; TE is faster). Untested in CI (no GPU).
    use_transformer_engine: bool = False
    # megatron backend: torch.compile the element-wise pieces (RMSNorm, SwiGLU; `compiled`)
    compile: bool = False
    # megatron backend: a prompt shared by samples of a micro-batch (a GRPO group) is computed
    # once, its responses attending to it as in their own sequences (`packing`)
    share_prompts: bool = True

    def __post_init__(self):
        if self.backend not in ("megatron", "deepspeed"):
            raise ValueError(f"trainer.backend={self.backend!r}; use 'megatron' or 'deepspeed'")
        if self.dtype not in ("float32", "bfloat16", "float64"):
            raise ValueError(
                f"trainer.dtype={self.dtype!r}; use 'float32', 'bfloat16' or 'float64'"
            )
        if self.dtype == "float64" and self.backend != "megatron":
            raise ValueError(
                "trainer.dtype='float64' runs on trainer.backend='megatron' only; "
                "use float32 with deepspeed"
            )
        if self.compile and self.backend != "megatron":
            raise ValueError(
                "trainer.compile=true runs on trainer.backend='megatron' only; set it to false"
            )
        if self.max_tokens_per_micro_batch < 1:
            raise ValueError("trainer.max_tokens_per_micro_batch must be >= 1")
        if self.loss.kl_coef > 0 and not self.use_reference:
            raise ValueError(
                "trainer.loss.kl_coef > 0 needs a reference model: set trainer.use_reference: true"
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

    def response_len(self, i: int) -> int:
        return len(self.tokens[i]) - self.prompt_lens[i]

    def subset(self, idx: list[int]) -> RLBatch:
        """The samples `idx`, in that order (a data-parallel rank's share)."""

        def pick(values):
            return None if values is None else [values[i] for i in idx]

        return RLBatch(
            tokens=pick(self.tokens),
            prompt_lens=pick(self.prompt_lens),
            **{name: pick(getattr(self, name)) for name in self._PER_TOKEN},
        )

    def __reduce__(self):
        # each per-token field as one flat tensor: pickling hundreds of small tensors one by
        # one is most of a Ray call's cost (`trainer.tensor_lists`); every field travels
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return _unpickle_batch, (values | {k: pack(values[k]) for k in self._PER_TOKEN},)


def _unpickle_batch(values: dict) -> RLBatch:
    return RLBatch(**{k: unpack(v) for k, v in values.items()})
