"""`EngineWorker`'s read-only views for checking a weight sync from outside the actor: the
bytes of every parameter and an FP8 KV pool's scales. A mixin of `EngineWorker` (it reads the
worker's `engine`, or `follower` on ranks 1..k-1 of a TP replica)."""

from __future__ import annotations

import hashlib

import torch


class EngineInspection:
    def weight_digests(self) -> dict[str, str]:
        """sha256 of every parameter's bytes, by HF name: to check a sync bitwise from outside
        (under TP: this rank's shards)."""
        return parameter_digests((self.engine or self.follower).model)

    def kv_scales(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """An FP8 KV pool's K and V scales [layers, KV heads] (under TP: this rank's heads), on
        the CPU; None for a pool in the model dtype. To check a calibration from outside."""
        pool = (self.engine or self.follower).pool
        if pool.k_scale is None:
            return None
        return pool.k_scale.cpu().clone(), pool.v_scale.cpu().clone()


def parameter_digests(model: torch.nn.Module) -> dict[str, str]:
    """sha256 of every parameter's bytes, by name."""
    return {
        name: hashlib.sha256(
            p.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, p in model.named_parameters()
    }
