"""The PPO critic on the megatron backend: the policy's backbone family with a value head.

The backbone is loaded from a HF checkpoint (usually the policy's); the LM head is replaced by a
zero-initialized linear value head (`megatron_runner._ValueHead`). Values are read at the same
packed positions as the response log-probs: the value of response token t is the head's output
at the position whose logits predict t, i.e. V(prompt + response[:t]).
"""

from __future__ import annotations

import dataclasses

import torch

from trainer import losses, objective
from trainer.config import RLBatch, TrainerConfig
from trainer.megatron_runner import MegatronModel, dp_share, reduce_metrics
from trainer.offload import OffloadPart
from trainer.packing import MicroBatch
from trainer.parallel import device, init_parallel

CRITIC_METRIC_KEYS = ("value_loss", "value_mean", "value_clipfrac")


def explained_variance(
    values: list[torch.Tensor],
    returns: list[torch.Tensor],
    loss_masks: list[torch.Tensor] | None = None,
) -> float:
    """1 - Var(R - V) / Var(R) over the (loss-masked) response tokens: 1 for a critic that
    predicts every return, 0 for one that predicts only their mean, negative for worse. The
    value loss alone cannot say which: it tracks Var(R), which moves with the policy (a binary
    reward's variance p(1 - p) grows as the success rate p climbs to 1/2)."""
    v = torch.cat([x.reshape(-1) for x in values]).double()
    r = torch.cat([x.reshape(-1) for x in returns]).double()
    if loss_masks is not None:
        keep = torch.cat([m.reshape(-1) for m in loss_masks]) > 0
        v, r = v[keep], r[keep]
    var = r.var(unbiased=False) if r.numel() else torch.zeros((), dtype=torch.float64)
    if var <= 0:
        return float("nan")
    return float(1.0 - (r - v).var(unbiased=False) / var)


class MegatronCritic:
    def __init__(self, cfg: TrainerConfig, *, value_clip: float | None = 0.2):
        init_parallel(cfg.tp, cfg.pp)
        self.cfg = cfg
        self.value_clip = value_clip
        self.model = MegatronModel(cfg, trainable=True, value_head=True)

    @staticmethod
    def _token_values(output: torch.Tensor, mb: MicroBatch) -> torch.Tensor:
        return output[0, :, 0].index_select(0, mb.read_rows.to(output.device))

    def compute_values(self, batch: RLBatch) -> list[torch.Tensor]:
        """Per-sample values of the response tokens, for the whole batch, on every rank."""
        return self.model.per_sample(batch, lambda out, mb: {"v": self._token_values(out, mb)})["v"]

    def train_step(self, batch: RLBatch) -> dict[str, float]:
        """One optimizer step of the clipped value loss toward `batch.returns`."""
        if batch.returns is None:
            raise ValueError("critic training needs batch.returns")
        if batch.old_values is None:
            batch = dataclasses.replace(batch, old_values=self.compute_values(batch))
        norm = objective.normalizers(batch)
        local = batch.subset(dp_share(len(batch.tokens)))
        dev = device()

        def packed(values: list[torch.Tensor], mb: MicroBatch) -> torch.Tensor:
            return torch.cat([values[i].reshape(-1) for i in mb.sample_indices]).to(
                dev, torch.promote_types(values[0].dtype, torch.float32)
            )

        def loss_fn(mb, output):
            values = self._token_values(output, mb)
            data = objective.token_data(local, mb, dev)
            returns, old = packed(local.returns, mb), packed(local.old_values, mb)
            per_token = losses.value_loss(values, old, returns, clip=self.value_clip)
            loss = losses.aggregate(
                per_token,
                data.mask,
                data.seq_ids,
                self.cfg.loss.loss_agg,
                total_tokens=norm.tokens,
                total_seqs=norm.seqs,
            )
            if self.value_clip is None:
                clipped = torch.zeros_like(values)
            else:
                clipped = ((values - old).abs() > self.value_clip).float()
            scale = 1.0 / max(norm.tokens, 1.0)
            return (
                loss,
                torch.tensor(1),
                {
                    "value_loss": loss.detach(),
                    "value_mean": (values.detach() * data.mask).sum() * scale,
                    "value_clipfrac": (clipped * data.mask).sum() * scale,
                },
            )

        stored = self.model.train_micro_batches(local, loss_fn)
        metrics = reduce_metrics(stored, CRITIC_METRIC_KEYS)
        skipped_before = self.model.skipped_steps
        grad_norm, lr = self.model.optimizer_step()
        metrics.update(
            grad_norm=grad_norm,
            lr=lr,
            update_skipped=float(self.model.skipped_steps > skipped_before),
        )
        return metrics

    def train_state(self) -> dict:
        """This rank's critic shard and its optimizer / schedule state."""
        return self.model.train_state(with_params=True)

    def load_train_state(self, state: dict) -> None:
        self.model.load_train_state(state)

    def offload(self, part: OffloadPart = "all") -> int:
        return self.model.offload(part)

    def onload(self) -> int:
        return self.model.onload()
