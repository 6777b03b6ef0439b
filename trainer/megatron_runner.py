"""One megatron-core model shard (policy, reference or critic) and how to run batches through it.

`MegatronModel` owns a GPTModel built from a HF checkpoint, loaded under this rank's TP x PP
slot, and - when trainable - megatron DDP around it plus the optimizer. Micro-batches are packed
sequences run through megatron's own pipeline schedules (`get_forward_backward_func`, which
also covers PP = 1). Gradients accumulate over micro-batches in DDP's grad buffers and are
all-reduced over DP once per step (reduce-scattered into DP shards with a distributed
optimizer).

Loss scaling: each micro-batch returns its share of the *global* loss (see `objective`), the
schedule is told not to rescale (`calculate_per_token_loss=True`, token count 1) and DDP then
sums rather than averages over DP. So the gradient is that of the whole batch's loss for any
TP / PP / DP / micro-batch split.

Optimizer (`megatron_optimizer`): torch's fused AdamW with our model-parallel grad norm
(`optim`; megatron's `clip_grads` allocates on "cuda"), over fp32 master weights held whole on
every DP rank or sharded over DP by megatron's DistributedOptimizer. With `dtype: bfloat16` the
model computes in bf16 while AdamW updates fp32 master copies of the weights from DDP's fp32
grad buffers (`grad_reduce_in_fp32`), then writes them back rounded to bf16 - the standard mixed
precision recipe.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

import collectives
from model_spec import ModelSpec
from trainer import megatron_moe, megatron_optimizer, routing_replay, shared_prompts, step_metrics
from trainer.bridge import HFCheckpoint, load_hf_weights
from trainer.config import RLBatch, TrainerConfig
from trainer.megatron_model import build_gpt_model
from trainer.offload import OffloadPart, synchronize
from trainer.optim import lr_at
from trainer.packing import MicroBatch, pack_all
from trainer.parallel import device
from trainer.response_rows import install as install_row_selection
from trainer.response_rows import selecting


def dp_share(n: int) -> list[int]:
    """Indices of the samples this data-parallel rank trains on (strided, so every rank gets
    a similar mix of lengths)."""
    dp = parallel_state.get_data_parallel_world_size()
    rank = parallel_state.get_data_parallel_rank()
    if n < dp:
        raise ValueError(
            f"batch has {n} samples but data-parallel size is {dp}; "
            "give every DP rank at least one sample"
        )
    return list(range(rank, n, dp))


def _packed_params(mb: MicroBatch, dev) -> PackedSeqParams:
    """megatron's view of `mb`; its shared-prompt layout, if any, is bound to the `cu_seqlens`
    tensor that attention and RoPE get (`shared_prompts`)."""
    cu = mb.cu_seqlens.to(dev)
    shared_prompts.bind(cu, None if mb.shared is None else shared_prompts.to_device(mb.shared, dev))
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )


def _finalize_grads(models, num_tokens=None, **_):
    # Our losses are already globally normalized: skip megatron's per-token rescaling.
    finalize_model_grads(models, num_tokens=None)


def all_gather_dicts(local: dict, group) -> dict:
    return {k: v for part in collectives.all_gather_object(local, group) for k, v in part.items()}


def from_last_stage(obj):
    """The last PP stage's `obj` on every stage of this pipeline."""
    stages = collectives.all_gather_object(obj, parallel_state.get_pipeline_model_parallel_group())
    return stages[-1]


def reduce_metrics(
    stored: list[dict], keys: Sequence[str], max_keys: Sequence[str] = ()
) -> dict[str, float]:
    """Sum metric shares over micro-batches and DP ranks (max for `max_keys`) on the device;
    every rank of the pipeline gets the last stage's result, read back once (`step_metrics`)."""
    dp_group = parallel_state.get_data_parallel_group()
    shares = step_metrics.stack_shares(stored, keys, collectives.group_device(dp_group))
    step_metrics.reduce_shares(shares, dp_group)
    pp_group = parallel_state.get_pipeline_model_parallel_group()
    collectives.broadcast(shares, src=collectives.size(pp_group) - 1, group=pp_group)
    return step_metrics.read_metrics(shares, keys, max_keys)


class _ValueHead(torch.nn.Module):
    """Stands in for GPTModel.output_layer in a critic: hidden [s, b, h] -> value [s, b, 1].

    Replicated on every TP rank (its input, after the final norm, is replicated), so its
    gradient is the same everywhere and it counts once in the grad norm."""

    def __init__(self, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.value = torch.nn.Linear(hidden, 1, bias=False, dtype=dtype)
        torch.nn.init.zeros_(self.value.weight)  # value 0 everywhere until trained

    def forward(self, hidden, weight=None, runtime_gather_output=None):
        return self.value(hidden), None


class MegatronModel:
    def __init__(self, cfg: TrainerConfig, *, trainable: bool, value_head: bool = False):
        self.cfg = cfg
        ckpt = HFCheckpoint(cfg.model_path)
        self.arch = ModelSpec.from_hf(ckpt.config())
        arch = self.arch
        if value_head:  # a critic never ties its (replaced) output layer to the embedding
            import dataclasses

            arch = dataclasses.replace(arch, tie_word_embeddings=False)
        model, self.layout = build_gpt_model(
            arch,
            params_dtype=cfg.torch_dtype,
            vocab_multiple=cfg.vocab_pad_multiple,
            use_te=cfg.use_transformer_engine,
            compile=cfg.compile,
            moe_aux_loss_coeff=cfg.moe_aux_loss_coeff if trainable and arch.moe else 0.0,
        )
        self.aux_loss_coeff = cfg.moe_aux_loss_coeff if trainable and arch.moe else 0.0
        self.aux_share = 1  # micro-batches x DP ranks of the last training step
        if value_head and self.layout.post_process:
            model.output_layer = _ValueHead(arch.hidden_size, cfg.torch_dtype).to(device())
        load_hf_weights(
            model, arch, self.layout, ckpt, skip_prefixes=("output_layer.",) if value_head else ()
        )
        if not value_head:  # the policy's log-probs may skip prompt rows (`run`)
            install_row_selection(model)
        # (routes column, replay) per router of this stage; replays only when given routes
        self.replays = routing_replay.install(model, arch.moe.sparse_layers) if arch.moe else []
        self.raw = model
        # a prompt shared by samples of a micro-batch runs once (`packing`); Transformer
        # Engine's attention cannot attend in that layout, ours can
        self.share_prompts = cfg.share_prompts and not cfg.use_transformer_engine
        self.config = model.config
        self.step_count = 0
        self.skipped_steps = 0  # updates skipped for a non-finite gradient norm
        if not trainable:
            for p in model.parameters():
                p.requires_grad_(False)
            self.module = model
            return
        self.config.calculate_per_token_loss = True
        sharded = megatron_optimizer.select(cfg)
        self.module = DistributedDataParallel(
            self.config,
            # float32 grad buffers for fp32/bf16 params; a float64 model keeps float64 grads
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=cfg.dtype != "float64",
                overlap_grad_reduce=False,
                # reduce-scatter the grads into DP shards, all-gather the updated weights
                use_distributed_optimizer=sharded,
            ),
            model,
        )
        self.config.no_sync_func = self.module.no_sync
        self.config.finalize_model_grads_func = _finalize_grads
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.optim = (
            megatron_optimizer.ShardedAdamW(self.module, self.params, cfg)
            if sharded
            else megatron_optimizer.ReplicatedAdamW(self.params, cfg)
        )

    @property
    def master(self) -> list[torch.Tensor]:
        """The tensors AdamW updates: fp32 masters (the params of a float32 / float64 model),
        or with a distributed optimizer this DP rank's shards of them."""
        return self.optim.masters

    # ----------------------------------------------------------------------------- running

    def run(
        self,
        micro_batches: Sequence[MicroBatch],
        loss_fn: Callable,
        forward_only: bool,
        response_rows: bool = False,
        routes: Sequence[torch.Tensor] | None = None,
    ) -> list:
        """Run the schedule; on the last PP stage returns loss_fn's metric dicts, else [].

        `response_rows`: the model's output (what `loss_fn(mb, output)` gets) covers only the
        micro-batch's read rows (`mb.logit_rows`; `mb.reads_of` gives one row per read): the
        last layer past its attention and the LM head skip the other rows (`response_rows`);
        without it the output covers every packed row.

        `routes`: per micro-batch its packed rows' experts [t, sparse layers, k]
        (`routing_replay.packed_routes`), replayed in its forward."""
        dev = device()
        per_mb = iter(routes) if routes is not None else None

        def forward_step(data_iterator: Iterator[MicroBatch], model):
            mb = next(data_iterator)
            rows = mb.logit_rows.to(dev) if response_rows else None
            if per_mb is not None:
                packed = next(per_mb)
                for column, replay in self.replays:
                    replay.replay(packed[:, column], mb.logit_rows if response_rows else None)
            try:
                with selecting(self.raw, rows):
                    out = model(
                        mb.input_ids.to(dev),
                        mb.position_ids.to(dev),
                        None,
                        packed_seq_params=_packed_params(mb, dev),
                    )
            finally:
                for _, replay in self.replays:
                    replay.stop()
            return out, functools.partial(loss_fn, mb)

        schedule = get_forward_backward_func()
        return schedule(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.module],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.num_tokens for mb in micro_batches),
            micro_batch_size=1,
            forward_only=forward_only,
        )

    def per_sample(
        self,
        batch: RLBatch,
        fn: Callable[[torch.Tensor, MicroBatch], dict[str, torch.Tensor]],
        response_rows: bool = False,
        replay: bool = False,
    ) -> dict:
        """Forward-only over the whole batch. `fn(output, mb)` returns per-response-token
        tensors (packed order); the result maps each name to a list with one tensor per sample
        of the batch, on every rank. `response_rows`: as in `run`; `replay`: route by the
        batch's `routed_experts` when it has them."""
        mine = dp_share(len(batch.tokens))
        local = batch.subset(mine)
        mbs = pack_all(
            local.tokens, local.prompt_lens, self.cfg.max_tokens_per_micro_batch, self.share_prompts
        )

        def loss_fn(mb, output):
            values = fn(output, mb)
            lengths = [batch.response_len(mine[i]) for i in mb.sample_indices]
            split = {k: [t.cpu() for t in v.detach().split(lengths)] for k, v in values.items()}
            out = {
                mine[i]: {k: split[k][j] for k in split} for j, i in enumerate(mb.sample_indices)
            }
            return torch.zeros((), device=output.device), torch.tensor(1), out

        was_training = self.module.training
        self.module.eval()
        with torch.no_grad():
            stored = self.run(
                mbs, loss_fn, True, response_rows, self.packed_routes(mbs, local, replay)
            )
        self.module.train(was_training)
        local = {k: v for out in stored for k, v in out.items()}
        merged = from_last_stage(all_gather_dicts(local, parallel_state.get_data_parallel_group()))
        names = next(iter(merged.values())).keys()
        return {k: [merged[i][k] for i in range(len(batch.tokens))] for k in names}

    def train_micro_batches(
        self, local: RLBatch, loss_fn: Callable, response_rows: bool = False
    ) -> list[dict]:
        """Forward + backward over this DP rank's share `local`; grads left in DDP buffers.
        `response_rows`: as in `run`; `local.routed_experts`, when given, are replayed."""
        mbs = pack_all(
            local.tokens, local.prompt_lens, self.cfg.max_tokens_per_micro_batch, self.share_prompts
        )
        self.module.train()
        self.module.zero_grad_buffer()
        if self.aux_loss_coeff > 0:
            self.aux_share = len(mbs) * parallel_state.get_data_parallel_world_size()
            megatron_moe.start_aux_loss_step(self.config, self.aux_loss_coeff, self.aux_share)
        routes = self.packed_routes(mbs, local, replay=True)
        return self.run(mbs, loss_fn, False, response_rows, routes)

    def aux_loss(self) -> float:
        """The last training step's load-balancing loss (`megatron_moe.aux_loss_share`: the mean
        over sparse layers and micro-batches of the switch loss, without the coefficient), the
        same on every rank; a collective."""
        value = megatron_moe.aux_loss_share(
            self.config, len(self.arch.moe.sparse_layers), self.aux_share
        )
        collectives.all_reduce(value, group=parallel_state.get_data_parallel_group())
        collectives.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
        return float(value)

    def packed_routes(
        self, mbs: Sequence[MicroBatch], local: RLBatch, replay: bool
    ) -> list[torch.Tensor] | None:
        """Each micro-batch's routes to replay (`routing_replay`); None: route freely."""
        if not replay or local.routed_experts is None:
            return None
        if self.arch.moe is None:
            raise ValueError("batch.routed_experts given for a dense model; it has no router")
        return [
            routing_replay.packed_routes(mb, local.tokens, local.prompt_lens, local.routed_experts)
            for mb in mbs
        ]

    def optimizer_step(self) -> tuple[float, float]:
        """Clip by the global grad norm, set the scheduled LR, step. Returns (grad_norm, lr).

        A non-finite grad norm (a NaN / inf loss or gradient anywhere in the model) skips the
        update: the weights, the optimizer state and the LR schedule stay as they were, and
        `skipped_steps` counts it. The norm is reduced over the model-parallel group, so every
        rank makes the same decision."""
        norm = self.optim.grad_norm()
        lr = lr_at(self.step_count, self.cfg.optim)
        if not math.isfinite(norm):
            self.optim.discard()
            self.skipped_steps += 1
            warnings.warn(
                f"non-finite gradient norm ({norm}); this update is skipped and the "
                "weights are unchanged",
                RuntimeWarning,
                stacklevel=2,
            )
            return norm, lr
        self.optim.step(lr, norm)
        self.step_count += 1
        return norm, lr

    # ----------------------------------------------------------------------------- state

    def train_state(self, with_params: bool) -> dict:
        """What this rank needs, beyond weights loaded at construction, to continue training
        exactly: AdamW's state, the LR-schedule position (`step_count`), `skipped_steps`, the
        fp32 master weights when they are separate copies (bf16; with a distributed optimizer
        this DP rank's shard of both), and with `with_params` this shard's parameters (a
        critic has no Hugging Face form). Tensors and plain values only, so
        `torch.load(weights_only=True)` reads it back."""
        state = {
            **self.optim.state_dict(),
            "step_count": self.step_count,
            "skipped_steps": self.skipped_steps,
        }
        if with_params:
            state["params"] = {n: p.detach().cpu() for n, p in self.raw.named_parameters()}
        return state

    def load_train_state(self, state: dict) -> None:
        """Inverse of `train_state` on a model built with the same layout."""
        if "params" in state:
            params = dict(self.raw.named_parameters())
            if params.keys() != state["params"].keys():
                raise ValueError("checkpointed parameters do not match this model's")
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(state["params"][name])
        self.optim.load_state_dict(state)
        self.step_count = int(state["step_count"])
        self.skipped_steps = int(state["skipped_steps"])

    # ----------------------------------------------------------------------------- memory

    def offload(self, part: OffloadPart = "all") -> int:
        """Free the grad buffers and move optimizer state ("optimizer") and params ("weights") to
        host memory; returns the bytes moved (on a CPU device nothing moves and the same count is
        reported)."""
        if part != "weights":
            self.module.offload_grad_buffers(synchronize=False, empty_cache=False)
        moved = self.optim.offload(part)
        synchronize(device())
        if device().type == "cuda":
            torch.cuda.empty_cache()
        return moved

    def onload(self) -> int:
        """Inverse of `offload` (grad buffers come back zeroed); returns the bytes moved."""
        dev = device()
        self.module.restore_grad_buffers(synchronize=False)
        moved = self.optim.onload(dev)
        synchronize(dev)
        return moved
