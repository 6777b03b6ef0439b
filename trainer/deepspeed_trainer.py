"""The DeepSpeed backend (`trainer.backend: deepspeed`) for plain HF transformers models.

Same interface and losses as `MegatronTrainer` (compute_logprobs, train_step, export,
offload / onload); data parallel only, with ZeRO stage 1, 2 or 3 sharding optimizer state
(1), gradients (2) and parameters (3). On CPU it runs with `"torch_adam": true` (DeepSpeed's
fused Adam is a CUDA op).

Micro-batches come from the same token-budget planner as the megatron backend. HF's SDPA
attention has no packed-sequence path, so each micro-batch is run as a right-padded batch
(padding is causal-invisible to real tokens) and the logits are gathered back into packed order.

Loss scaling: every micro-batch contributes its share of the global loss (`objective`), the
accumulation boundary is set by hand (one `engine.step()` per train_step), and because
DeepSpeed *averages* gradients over data-parallel ranks each share is multiplied by the DP size
so the result is the gradient of the whole batch's loss.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist

import collectives
from trainer import objective, step_metrics
from trainer.config import RLBatch, TrainerConfig
from trainer.hf_experts import per_expert
from trainer.hf_routing_replay import HFRouteReplay, check_routes, replaying
from trainer.logprobs import full_vocab_logprobs
from trainer.mismatch import mismatch_metrics
from trainer.offload import OffloadPart, tensors_bytes
from trainer.optim import lr_at
from trainer.packing import MicroBatch, pack_all
from trainer.parallel import device, init_distributed


def ds_config(cfg: TrainerConfig) -> dict:
    """DeepSpeed's configuration for `cfg`: one micro-batch per pass, ZeRO `cfg.zero_stage`,
    torch's AdamW (the same on CPU and GPU), clipping and bf16 as the config says."""
    o = cfg.optim
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,  # boundaries are set by hand per train_step
        # ZeRO-3's memory-efficient linear replaces torch.nn.functional.linear for the
        # whole process, for good: anything else in it (an engine, a reference model, a
        # second trainer) would then compute its linears through ZeRO's autograd function
        "zero_optimization": {"stage": cfg.zero_stage, "memory_efficient_linear": False},
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": lr_at(0, o),
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                "torch_adam": True,
            },
        },
        "gradient_clipping": o.grad_clip or 0.0,
        "bf16": {"enabled": cfg.dtype == "bfloat16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def gathered_parameters(module, zero_stage: int) -> Iterator[tuple[str, torch.Tensor]]:
    """`module`'s (name, full parameter), one at a time. ZeRO 1/2 keep full parameters on every
    rank; under ZeRO-3 each parameter is gathered (a collective: every rank iterates) and a
    copy is yielded. Tied embeddings appear once, as model.embed_tokens.weight."""
    import deepspeed

    for name, param in module.named_parameters():
        if zero_stage == 3:
            with deepspeed.zero.GatheredParameters([param]):
                yield name, param.detach().clone()
        else:
            yield name, param.detach()


def padded_rows(mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, attention mask), both [sequences, longest]: the packed micro-batch's
    sequences right-padded, one per row (padding is causal-invisible to the real tokens)."""
    bounds = mb.cu_seqlens.tolist()
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    ids = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    attn = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    flat = mb.input_ids[0]
    for row, (a, n) in enumerate(zip(bounds[:-1], lengths)):
        ids[row, :n] = flat[a : a + n]
        attn[row, :n] = 1
    return ids, attn


def dp_share(n: int) -> list[int]:
    """Indices of the samples this data-parallel rank (every rank of the world) trains on."""
    dp, rank = dist.get_world_size(), dist.get_rank()
    if n < dp:
        raise ValueError(
            f"batch has {n} samples but data-parallel size is {dp}; "
            "give every DP rank at least one sample"
        )
    return list(range(rank, n, dp))


def lockstep(mbs: list[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
    """(micro-batch, is_real) with the same length on every DP rank. ZeRO reduces grads in
    every backward (and ZeRO-3 gathers parameters in every forward), so ranks must run the
    same number of passes: a rank with fewer repeats its first micro-batch, marked unreal.
    The count is agreed on the world's device (`collectives`) and read back once."""
    count = collectives.all_reduce(torch.tensor(len(mbs)), op=collectives.ReduceOp.MAX)
    return [(mbs[j], True) if j < len(mbs) else (mbs[0], False) for j in range(int(count))]


def reduce_step_metrics(stored: list[dict]) -> dict[str, float]:
    """The step's metrics from the real passes' shares: summed (`ratio_max`: maxed) over
    passes and ranks on the world's device, read back once (`step_metrics`)."""
    keys = objective.METRIC_KEYS
    shares = step_metrics.stack_shares(stored, keys, collectives.group_device())
    return step_metrics.read_metrics(step_metrics.reduce_shares(shares), keys, ("ratio_max",))


class DeepSpeedTrainer:
    def __init__(self, cfg: TrainerConfig):
        import deepspeed
        import transformers

        if cfg.backend != "deepspeed":
            raise ValueError(f"DeepSpeedTrainer got trainer.backend={cfg.backend!r}")
        if cfg.tp != 1 or cfg.pp != 1:
            raise ValueError(
                "trainer.backend: deepspeed is data parallel only; set trainer.tp and "
                "trainer.pp to 1"
            )
        if cfg.zero_stage not in (1, 2, 3):
            raise ValueError(
                f"trainer.zero_stage={cfg.zero_stage}: the deepspeed backend "
                "supports ZeRO stage 1, 2 or 3"
            )
        self.cfg = cfg
        init_distributed()
        if "LOCAL_RANK" not in os.environ and dist.get_world_size() == 1:
            os.environ["LOCAL_RANK"] = "0"  # DeepSpeed asserts it is set, even for one process
        model = transformers.AutoModelForCausalLM.from_pretrained(
            cfg.model_path, dtype=cfg.torch_dtype, attn_implementation="sdpa"
        )
        self.vocab_size = model.config.vocab_size
        self.replay = HFRouteReplay.of(model)  # a mixture's routes replay; None when dense
        o = cfg.optim
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [  # as in the megatron backend: no weight decay on norms and biases
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
        ]
        self.reference = None
        if cfg.use_reference:  # frozen copy for KL; a plain module, outside DeepSpeed
            self.reference = transformers.AutoModelForCausalLM.from_pretrained(
                cfg.reference_path or cfg.model_path,
                dtype=cfg.torch_dtype,
                attn_implementation="sdpa",
            ).eval()
            self.reference.requires_grad_(False)
            self.reference.to("cpu" if cfg.reference_on_cpu else device())
        self.sampling = None  # frozen copy of the weights the engines sample with (host)
        if device().type != "cuda":
            # DeepSpeed's comm backend on CPU JIT-compiles its shared-memory all-reduce (ninja,
            # g++: minutes of CPU the first time on a machine) for its inference all-reduce
            # only, which ZeRO training never calls. Marked incompatible in the probe's dict
            # (module state DeepSpeed reads), the backend starts on torch.distributed alone.
            deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=groups, config=ds_config(cfg), dist_init_required=False
        )  # init_distributed() above owns the process group
        self.step_count = 0

    # ----------------------------------------------------------------------------- forward

    def _forward(
        self, mb: MicroBatch, model=None, local: RLBatch | None = None, counting: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Response-token (logprobs, entropy) of one micro-batch, in packed order (`replaying`)."""
        dev = device()
        ids, attn = padded_rows(mb)
        with replaying(self.replay if model is None else None, mb, attn, local, counting):
            model = self.engine if model is None else model
            logits = model(input_ids=ids.to(dev), attention_mask=attn.to(dev)).logits
        packed = logits[attn.to(dev).bool()]  # [t, V] in packed order (row-major)
        # only the read rows go through the softmax (unshared packing: each row read at most once)
        out = full_vocab_logprobs(
            packed.index_select(0, mb.read_rows.to(dev)),
            mb.read_targets.to(dev),
            temperature=self.cfg.loss.temperature,
        )
        return out.logprobs, out.entropy

    def compute_logprobs(self, batch: RLBatch, with_entropy: bool = False, model=None):
        """Per-sample response-token log-probs (and entropy) for the whole batch, every rank; the
        policy (not the reference nor the sampling copy) replays `batch.routed_experts`."""
        check_routes(self.replay, batch)
        mine = dp_share(len(batch.tokens))
        local_batch = batch.subset(mine)
        mbs = pack_all(
            local_batch.tokens, local_batch.prompt_lens, self.cfg.max_tokens_per_micro_batch
        )
        local = {}
        self.engine.eval()
        passes = (
            lockstep(mbs)
            if model is None and self.cfg.zero_stage == 3
            else [(mb, True) for mb in mbs]
        )
        with torch.no_grad():
            for mb, real in passes:
                lp, ent = self._forward(mb, model, local_batch, counting=False)
                if not real:
                    continue
                lengths = [batch.response_len(mine[i]) for i in mb.sample_indices]
                for i, a, b in zip(mb.sample_indices, lp.split(lengths), ent.split(lengths)):
                    local[mine[i]] = (a.cpu(), b.cpu())
        self.engine.train()
        local = {k: v for part in collectives.all_gather_object(local) for k, v in part.items()}
        lps = [local[i][0] for i in range(len(batch.tokens))]
        return (lps, [local[i][1] for i in range(len(batch.tokens))]) if with_entropy else lps

    def compute_ref_logprobs(self, batch: RLBatch) -> list[torch.Tensor]:
        if self.reference is None:
            raise ValueError("no reference model: set trainer.use_reference: true")
        if self.cfg.reference_on_cpu:
            self.reference.to(device())
        try:
            return self.compute_logprobs(batch, model=self.reference)
        finally:
            if self.cfg.reference_on_cpu:
                self.reference.to("cpu")

    def keep_sampling_weights(self, path: str | None = None) -> None:
        """Copy the current weights, bitwise, into a frozen HF model in host memory (built on
        first use), or load `path`'s; see `MegatronTrainer.keep_sampling_weights`."""
        import transformers

        if self.sampling is None or path is not None:
            self.sampling = (
                transformers.AutoModelForCausalLM.from_pretrained(
                    path or self.cfg.model_path,
                    dtype=self.cfg.torch_dtype,
                    attn_implementation="sdpa",
                )
                .eval()
                .requires_grad_(False)
            )
            if path is not None:
                return
        kept = dict(self.sampling.named_parameters())
        with torch.no_grad():
            for name, tensor in gathered_parameters(self.engine.module, self.cfg.zero_stage):
                kept[name].copy_(tensor)

    def compute_sampling_logprobs(self, batch: RLBatch) -> list[torch.Tensor]:
        """Log-probs under the weights `keep_sampling_weights` copied."""
        if self.sampling is None:
            raise ValueError("no sampling weights kept: call keep_sampling_weights() first")
        self.sampling.to(device())
        try:
            return self.compute_logprobs(batch, model=self.sampling)
        finally:
            self.sampling.to("cpu")

    # ----------------------------------------------------------------------------- training

    def train_step(self, batch: RLBatch) -> dict[str, float]:
        """One optimizer step on the whole batch; see `MegatronTrainer.train_step`."""
        return self.train_step_scored(batch).metrics

    def train_step_scored(self, batch: RLBatch) -> objective.ScoredStep:
        """`train_step`, also returning the old log-probs its forward supplied (every rank)."""
        check_routes(self.replay, batch)
        cfg = self.cfg
        batch = objective.complete_batch(batch, cfg.loss, self.compute_ref_logprobs)
        fused = objective.old_from_forward(batch, cfg.loss)
        norm = objective.normalizers(batch)
        old: dict = {}
        mine = dp_share(len(batch.tokens))
        local = batch.subset(mine)
        mbs = pack_all(local.tokens, local.prompt_lens, cfg.max_tokens_per_micro_batch)
        dev = device()
        dp = dist.get_world_size()
        lr = lr_at(self.step_count, cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        passes = lockstep(mbs)  # extra passes carry weight 0
        self.engine.train()
        stored = []  # the real passes' metric shares, on the device
        for j, (mb, real) in enumerate(passes):
            self.engine.set_gradient_accumulation_boundary(j == len(passes) - 1)
            lp, ent = self._forward(mb, local=local, counting=real)
            data = objective.token_data(local, mb, dev)
            loss, metrics = objective.micro_batch_objective(lp, ent, data, cfg.loss, norm)
            # DeepSpeed averages over DP while our shares are meant to be summed: scale by dp.
            self.engine.backward(loss * (dp if real else 0.0))
            if real:
                if fused:
                    old.update(objective.split_by_sample(lp, local, mb, mine))
                stored.append(metrics)
        self.engine.step()
        self.step_count += 1

        result = reduce_step_metrics(stored)
        if batch.routed_experts is not None:
            result["routing_agreement"] = self.replay.take_agreement()
        old_list = None
        if fused:
            old = {k: v for part in collectives.all_gather_object(old) for k, v in part.items()}
            old_list = [old[i] for i in range(len(batch.tokens))]
            batch = dataclasses.replace(batch, old_logprobs=old_list)
        norm_value = self.engine.get_global_grad_norm()
        result.update(
            grad_norm=float(norm_value) if norm_value is not None else float("nan"),
            lr=lr,
            **mismatch_metrics(batch, cfg.loss),  # before the update: the forward's log-probs
        )
        return objective.ScoredStep(result, old_list)

    # ----------------------------------------------------------------------------- weights

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) pairs under the checkpoint's names (a mixture's experts one by
        one: `hf_experts`), one at a time (`gathered_parameters`); every rank iterates."""
        return per_expert(gathered_parameters(self.engine.module, self.cfg.zero_stage))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu().clone() for k, v in self.export_hf_weights()}

    # ----------------------------------------------------------------------------- state

    def train_state(self) -> dict:
        """This rank's optimizer state beyond the weights (which the HF export holds): its fp32
        master partitions, the torch AdamW state over them, the LR-schedule position. Tensors
        and plain values only (`torch.load(weights_only=True)` reads it). ZeRO 1 / 2 only."""
        opt = self._zero12("saving the optimizer state")
        return {
            "master": [t.detach().cpu() for t in opt.single_partition_of_fp32_groups],
            "optimizer": opt.optimizer.state_dict(),
            "step_count": self.step_count,
        }

    def load_train_state(self, state: dict) -> None:
        """Inverse of `train_state`, on a trainer built from the checkpoint's HF weights (so the
        model's weights already equal the masters' rounding)."""
        opt = self._zero12("resuming")
        with torch.no_grad():
            for t, saved in zip(opt.single_partition_of_fp32_groups, state["master"], strict=True):
                t.copy_(saved)
        opt.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])

    def _zero12(self, what: str):
        if self.cfg.zero_stage == 3 or not hasattr(
            self.optimizer, "single_partition_of_fp32_groups"
        ):
            raise NotImplementedError(
                f"{what} with trainer.zero_stage: 3 is not supported; use "
                "zero_stage 1 or 2, or the megatron backend"
            )
        return self.optimizer

    # ----------------------------------------------------------------------------- memory

    def _state_bytes(self) -> int:
        """Bytes of the ZeRO optimizer's buffers: fp32 master partitions, the flat model
        weights, Adam moments (what `offload_states` moves)."""
        opt = self.optimizer
        tensors = []
        for attr in (
            "single_partition_of_fp32_groups",
            "bit16_groups_flat",  # ZeRO 1/2
            "fp32_partitioned_groups_flat",
            "fp16_partitioned_groups_flat",
        ):  # ZeRO 3
            tensors += [t for t in getattr(opt, attr, None) or [] if torch.is_tensor(t)]
        inner = getattr(opt, "optimizer", opt)
        for state in inner.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        return tensors_bytes(tensors)

    def offload(self, part: OffloadPart = "all") -> int:
        """Move master weights, grads and optimizer state ("optimizer") and params ("weights")
        to host memory with DeepSpeed's own `offload_states` (it re-links the model's views);
        returns the bytes of state moved (on a CPU device nothing moves and the same count is
        reported)."""
        if self.cfg.zero_stage == 3:
            # DeepSpeed 0.19's ZeRO-3 offload_states requires its fused (CUDA) Adam; we run
            # torch's Adam ("torch_adam": true) so that one code path serves CPU and GPU.
            raise NotImplementedError(
                "offload with trainer.zero_stage: 3 is not supported; "
                "use zero_stage 1 or 2, or the megatron backend"
            )
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum as State

        weights = {State.lp_params}
        include = {
            "all": None,
            "weights": weights,
            "optimizer": set(State) - weights,
        }[part]
        moved = self._state_bytes()
        flat_weights = tensors_bytes(getattr(self.optimizer, "bit16_groups_flat", None) or [])
        moved = {"all": moved, "weights": flat_weights, "optimizer": moved - flat_weights}[part]
        self.engine.offload_states(include=include, pin_memory=device().type == "cuda")
        return moved

    def onload(self) -> int:
        self.engine.reload_states()
        return self._state_bytes()
