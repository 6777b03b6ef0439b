"""The trainer's collectives take their tensors on the group's device (review rows A1-A3, B3).

On a GPU megatron's groups are NCCL, which reduces CUDA tensors only: a host tensor fails at the
call, and only on a GPU machine. Here every group reports two ranks and its device is `meta`
(`collectives.group_device` patched), and the raw torch.distributed collectives are fakes that
assert each tensor they get is on that device. So a caller that hands a collective a host
tensor (today's metric sums, gradient norms, DeepSpeed's pass count, a TP gather after offload)
fails here as it would on NCCL. Values are not checked here (the gloo runs of
test_parallel_layouts.py compare them); a meta tensor has none to read, so a caller whose
collectives all passed stops at its single read-back to the host, which `run_to_read_back`
accepts after checking the collectives made so far.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

import collectives
import collectives.ops
from model_spec import ModelSpec
from trainer import deepspeed_trainer
from trainer.bridge import HFCheckpoint, export_hf_weights, load_hf_weights
from trainer.megatron_model import build_gpt_model
from trainer.megatron_runner import reduce_metrics
from trainer.optim import grad_norm
from trainer.packing import pack_all
from trainer.parallel import init_parallel

META = torch.device("meta")
READ_BACK = ("Cannot copy out of meta tensor", "cannot be called on meta tensors")


class FakeGroups:
    """Every group: two ranks, device meta; collectives recorded by name."""

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        init_parallel()  # megatron's groups exist (a 1-process gloo world)
        monkeypatch.setattr(collectives, "group_device", lambda group=None: META)
        monkeypatch.setattr(collectives.ops, "group_device", lambda group=None: META)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        for name in (
            "get_tensor_model_parallel_world_size",
            "get_pipeline_model_parallel_world_size",
            "get_data_parallel_world_size",
        ):
            monkeypatch.setattr(parallel_state, name, lambda: 2)
        for name in (
            "all_reduce",
            "all_gather",
            "broadcast",
            "all_to_all_single",
        ):
            monkeypatch.setattr(dist, name, self._tensor_collective(name))
        monkeypatch.setattr(dist, "all_gather_object", self._all_gather_object)

    def _tensor_collective(self, name):
        def fake(*args, **kwargs):
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            tensors += [t for a in args if isinstance(a, list) for t in a]
            for t in tensors:
                assert t.device == META, f"{name} got a tensor on {t.device}, not the group's"
            self.calls.append(name)

        return fake

    def _all_gather_object(self, parts, obj, group=None):
        self.calls.append("all_gather_object")
        parts[:] = [obj] * len(parts)

    def run_to_read_back(self, fn, expected_calls: list[str]):
        """Run `fn`; it may only stop at a read-back of a meta tensor, after `expected_calls`."""
        try:
            fn()
        except (NotImplementedError, RuntimeError) as e:
            if not any(m in str(e) for m in READ_BACK):
                raise
        assert self.calls == expected_calls


@pytest.fixture
def groups(monkeypatch):
    return FakeGroups(monkeypatch)


@pytest.mark.parametrize("where", ["host", "device"])
def test_reduce_metrics_reduces_on_the_group_device(groups, where):
    # metric shares as a loss function leaves them: on the device, or on the host
    device = META if where == "device" else torch.device("cpu")
    stored = [{"loss": torch.tensor(0.5, device=device), "ratio_max": torch.tensor(1.5)}] * 3
    groups.run_to_read_back(
        lambda: reduce_metrics(stored, ["loss", "ratio_max"], max_keys=("ratio_max",)),
        ["all_reduce", "all_reduce", "broadcast"],  # DP sums, DP maxes, from the last stage
    )


def test_grad_norm_reduces_on_the_group_device(groups):
    params = [torch.nn.Parameter(torch.empty(s, device=META)) for s in ((3, 4), (5,), (2, 2))]
    for p in params:
        p.grad = torch.empty_like(p)
    groups.run_to_read_back(lambda: grad_norm(params), ["all_reduce"])


def test_deepspeed_pass_count_is_agreed_on_the_group_device(groups):
    mbs = pack_all([[1, 2, 3, 4], [5, 6, 7]], [1, 1], max_tokens=4)
    groups.run_to_read_back(lambda: deepspeed_trainer.lockstep(mbs), ["all_reduce"])


@pytest.mark.parametrize("where", ["host", "device"])
def test_deepspeed_metric_totals_reduce_on_the_group_device(groups, where):
    device = META if where == "device" else torch.device("cpu")
    from trainer.objective import METRIC_KEYS

    stored = [{k: torch.tensor(0.25, device=device) for k in METRIC_KEYS}] * 2
    groups.run_to_read_back(
        lambda: deepspeed_trainer.reduce_step_metrics(stored), ["all_reduce"] * 2
    )


@pytest.fixture(scope="module")
def host_model(tiny_hf_checkpoints):
    """A megatron model whose shards are on the host, as after `offload`."""
    _, directory = tiny_hf_checkpoints("qwen2")
    ckpt = HFCheckpoint(directory)
    arch = ModelSpec.from_hf(ckpt.config())
    init_parallel()
    model, layout = build_gpt_model(arch)
    load_hf_weights(model, arch, layout, ckpt)
    assert all(p.device.type == "cpu" for p in model.parameters())
    return model, arch, layout


def test_tp_gather_of_host_shards_runs_on_the_group_device(host_model, groups):
    """A checkpoint taken after offload exports host shards over the TP group (B3)."""
    model, arch, layout = host_model
    # the embedding (vocab rows over TP) comes first: one gather
    groups.run_to_read_back(lambda: next(export_hf_weights(model, arch, layout)), ["all_gather"])
