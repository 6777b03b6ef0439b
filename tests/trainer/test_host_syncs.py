"""Host synchronisations of one megatron train step do not grow with the parameter count.

On a GPU every read of a device value on the host (`.item()`, `.tolist()`, `.cpu()`, `float()`,
`bool()`, `nonzero`, a boolean-mask index) waits for the device to drain. A step that reads one
value per parameter (a gradient norm per tensor) or per metric and micro-batch stalls the GPU
hundreds of times per step. Here the same step runs on two models, the larger with about 4x
the parameters (and parameter tensors), and every such call is counted (a TorchFunctionMode
sees each one, in our code and megatron's): the counts must be equal. On the CPU a host tensor
counts too, so the count is an upper bound of the GPU's syncs.
"""

from __future__ import annotations

import collections
import traceback

import torch
from torch.overrides import TorchFunctionMode

from trainer import make_trainer

import scenarios
from tiny_hf import make_hf_model, save_hf_model

SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__index__,
}


def _bool_mask_index(func, args) -> bool:
    return (
        func is torch.Tensor.__getitem__
        and len(args) > 1
        and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if isinstance(args[1], tuple) else (args[1],))
        )
    )


class HostSyncs(TorchFunctionMode):
    """Counts host reads by (call, the innermost frame outside torch)."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS or _bool_mask_index(func, args):
            frame = [f for f in traceback.extract_stack()[:-1] if "/torch/" not in f.filename][-1]
            name = getattr(func, "__name__", func)
            self.counts[f"{name} at {frame.filename}:{frame.lineno}"] += 1
        return func(*args, **(kwargs or {}))


def _step_syncs(directory) -> tuple[collections.Counter, int]:
    trainer = make_trainer(scenarios.trainer_config(directory))
    batch = scenarios.fixed_batch(trainer.vocab_size)
    trainer.train_step(batch)  # the first step creates the optimizer's state
    with HostSyncs() as syncs:
        trainer.train_step(batch)
    return syncs.counts, sum(p.numel() for p in trainer.params)


def test_host_syncs_of_a_train_step_do_not_grow_with_parameters(tmp_path):
    small, n_small = _step_syncs(
        save_hf_model(make_hf_model("qwen2", seed=1, num_hidden_layers=2), tmp_path / "small")
    )
    large, n_large = _step_syncs(
        save_hf_model(make_hf_model("qwen2", seed=1, num_hidden_layers=9), tmp_path / "large")
    )
    assert n_large >= 3.5 * n_small
    grown = {k: (small[k], v) for k, v in large.items() if v > small[k]}
    assert not grown, f"host reads growing with the parameter count (small, large): {grown}"
