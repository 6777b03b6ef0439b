"""The megatron-core policy trainer: policy (+ optional frozen reference) under TP x PP x DP.

One `MegatronTrainer` per trainer process; every process of the torch.distributed world
constructs it and calls each method together (there are collectives inside). The mechanics
(packing, schedules, DDP, optimizer, offload) live in `megatron_runner`; this file is the RL
policy step: reference log-probs where needed, the objective (old log-probs from the step's own
forward when the batch has none), one optimizer step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import torch
from megatron.core import parallel_state

from trainer import objective, routing_replay
from trainer.bridge import export_engine_shards, export_hf_weights, gather_hf_state_dict
from trainer.config import RLBatch, TrainerConfig
from trainer.logprobs import vocab_parallel_logprobs
from trainer.megatron_runner import (
    MegatronModel,
    all_gather_dicts,
    dp_share,
    from_last_stage,
    reduce_metrics,
)
from trainer.mismatch import mismatch_metrics
from trainer.offload import OffloadPart, move_params
from trainer.packing import MicroBatch
from trainer.parallel import device, init_parallel


class MegatronTrainer:
    def __init__(self, cfg: TrainerConfig):
        if cfg.backend != "megatron":
            raise ValueError(f"MegatronTrainer got trainer.backend={cfg.backend!r}")
        self.cfg = cfg
        init_parallel(cfg.tp, cfg.pp)
        self.policy = MegatronModel(cfg, trainable=True)
        self.reference = None
        if cfg.use_reference:
            self.reference = MegatronModel(
                dataclasses.replace(cfg, model_path=cfg.reference_path or cfg.model_path),
                trainable=False,
            )
        if self.reference is not None and cfg.reference_on_cpu:
            move_params(self.reference.raw.parameters(), torch.device("cpu"))
        self.sampling = None  # frozen copy of the weights the engines sample with (host)

    @property
    def arch(self):
        return self.policy.arch

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size

    @property
    def params(self) -> list[torch.nn.Parameter]:
        return self.policy.params

    # ----------------------------------------------------------------------------- log-probs

    def _token_logprobs(self, model: MegatronModel, logits: torch.Tensor, mb: MicroBatch):
        # `logits` [1, m, V] at `mb.logit_rows` (the model ran with `response_rows`)
        out = vocab_parallel_logprobs(
            mb.reads_of(logits[0]),
            mb.read_targets.to(logits.device),
            vocab_size=model.arch.vocab_size,
            temperature=self.cfg.loss.temperature,
            entropy_grad=bool(self.cfg.loss.entropy_coef),
        )
        return out.logprobs, out.entropy

    def _logprobs_of(
        self, model: MegatronModel, batch: RLBatch, with_entropy: bool, replay: bool = False
    ):
        def fn(logits, mb):
            lp, ent = self._token_logprobs(model, logits, mb)
            return {"lp": lp, "ent": ent}

        out = model.per_sample(batch, fn, response_rows=True, replay=replay)
        return (out["lp"], out["ent"]) if with_entropy else out["lp"]

    def compute_logprobs(self, batch: RLBatch, with_entropy: bool = False):
        """Per-sample response-token log-probs (and entropy) under logits / temperature, for
        the whole batch, on every rank; a mixture routes by `batch.routed_experts` when given."""
        return self._logprobs_of(self.policy, batch, with_entropy, replay=True)

    def compute_ref_logprobs(self, batch: RLBatch) -> list[torch.Tensor]:
        if self.reference is None:
            raise ValueError("no reference model: set trainer.use_reference: true")
        if self.cfg.reference_on_cpu:
            move_params(self.reference.raw.parameters(), device())
        try:
            return self._logprobs_of(self.reference, batch, False)
        finally:
            if self.cfg.reference_on_cpu:
                move_params(self.reference.raw.parameters(), torch.device("cpu"))

    def keep_sampling_weights(self, path: str | None = None) -> None:
        """Copy the current weights, bitwise, into a frozen model in host memory (built on first
        use), or with `path` load that HF directory's instead (a resumed run: the engine-side
        weights of its checkpoint). Off policy the engines sample the next batch with exactly
        these weights (they were just synced), so `compute_sampling_logprobs` can later score
        that batch under them: the precision mismatch apart from the policy lag."""
        if self.sampling is None or path is not None:
            self.sampling = MegatronModel(
                dataclasses.replace(self.cfg, model_path=path or self.cfg.model_path),
                trainable=False,
            )
            move_params(self.sampling.raw.parameters(), torch.device("cpu"))
            if path is not None:
                return
        with torch.no_grad():
            for kept, current in zip(
                self.sampling.raw.parameters(), self.policy.raw.parameters(), strict=True
            ):
                kept.copy_(current)

    def compute_sampling_logprobs(self, batch: RLBatch) -> list[torch.Tensor]:
        """Log-probs under the weights `keep_sampling_weights` copied."""
        if self.sampling is None:
            raise ValueError("no sampling weights kept: call keep_sampling_weights() first")
        move_params(self.sampling.raw.parameters(), device())
        try:
            return self._logprobs_of(self.sampling, batch, False)
        finally:
            move_params(self.sampling.raw.parameters(), torch.device("cpu"))

    # ----------------------------------------------------------------------------- training

    def train_step(self, batch: RLBatch) -> dict[str, float]:
        """One optimizer step on the whole batch (gradient accumulation over micro-batches).

        Missing old log-probs come from this step's own forward (on-policy: the ratio is
        exactly 1 and PPO-KL exactly 0; `objective`); missing reference log-probs come from
        the reference. With `batch.routed_experts` a mixture replays them in the forward
        (`routing_replay`) and reports `routing_agreement`."""
        return self.train_step_scored(batch).metrics

    def train_step_scored(self, batch: RLBatch) -> objective.ScoredStep:
        """`train_step`, also returning the old log-probs its forward supplied (every rank)."""
        cfg = self.cfg
        batch = objective.complete_batch(batch, cfg.loss, self.compute_ref_logprobs)
        fused = objective.old_from_forward(batch, cfg.loss)
        norm = objective.normalizers(batch)
        mine = dp_share(len(batch.tokens))
        local = batch.subset(mine)
        dev = device()

        def loss_fn(mb, logits):
            lp, ent = self._token_logprobs(self.policy, logits, mb)
            data = objective.token_data(local, mb, dev)
            loss, metrics = objective.micro_batch_objective(lp, ent, data, cfg.loss, norm)
            if fused:
                metrics["old_logprobs"] = objective.split_by_sample(lp, local, mb, mine)
            return loss, torch.tensor(1), metrics

        routing_replay.reset(self.policy.replays)
        stored = self.policy.train_micro_batches(local, loss_fn, response_rows=True)
        metrics = reduce_metrics(stored, objective.METRIC_KEYS, max_keys=("ratio_max",))
        if batch.routed_experts is not None:
            metrics["routing_agreement"] = routing_replay.agreement(self.policy.replays)
        if self.policy.aux_loss_coeff > 0:
            metrics["moe_aux_loss"] = self.policy.aux_loss()
        old = None
        if fused:
            mine_old = {i: t for m in stored for i, t in m["old_logprobs"].items()}
            merged = from_last_stage(
                all_gather_dicts(mine_old, parallel_state.get_data_parallel_group())
            )
            old = [merged[i] for i in range(len(batch.tokens))]
            batch = dataclasses.replace(batch, old_logprobs=old)
        skipped_before = self.policy.skipped_steps
        grad_norm, lr = self.policy.optimizer_step()
        metrics.update(
            grad_norm=grad_norm,
            lr=lr,
            **mismatch_metrics(batch, cfg.loss),  # before the update: the forward's log-probs
            update_skipped=float(self.policy.skipped_steps > skipped_before),
        )
        return objective.ScoredStep(metrics, old)

    # ----------------------------------------------------------------------------- weights

    def export_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, full tensor) for this PP stage's parameters, TP-gathered one at a time."""
        return export_hf_weights(self.policy.raw, self.arch, self.policy.layout)

    def export_engine_shards(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(hf_name, this TP rank's engine shard) for an engine of the same TP size: what engine
        TP rank r loads, from trainer TP rank r's own shard (no gather)."""
        return export_engine_shards(self.policy.raw, self.arch, self.policy.layout)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return gather_hf_state_dict(self.policy.raw, self.arch, self.policy.layout)

    # ----------------------------------------------------------------------------- state

    def train_state(self) -> dict:
        """This rank's optimizer / schedule state (the weights are the HF export)."""
        return self.policy.train_state(with_params=False)

    def load_train_state(self, state: dict) -> None:
        self.policy.load_train_state(state)

    # ----------------------------------------------------------------------------- memory

    def offload(self, part: OffloadPart = "all") -> int:
        return self.policy.offload(part)

    def onload(self) -> int:
        return self.policy.onload()
