"""Run megatron-core 0.16.1 on machines without CUDA.

megatron-core is written for GPUs: a handful of its modules call `torch.cuda.current_device()`
to pick where a buffer lives, `torch.cuda.synchronize()` around communication, and the pipeline
schedules allocate a token counter with `device="cuda"`. The math itself is device-agnostic, so
on a CPU-only machine we give exactly those modules a stand-in for their module-level `torch`
name: `_CpuTorch` forwards every attribute to the real torch, except that

* `torch.cuda.current_device()` answers `"cpu"` and `synchronize()` / `empty_cache()` do nothing;
* tensor factories (`empty`, `zeros`, `ones`, `full`, `tensor`, `arange`) map `device="cuda"`
  to `"cpu"`.

Why module-scoped and not a global monkey patch of `torch.cuda`: other code in the same process
(the rollout engine, user code, torch itself) must keep seeing the truth that CUDA is absent.

Two megatron methods need more than a `torch` stand-in and are wrapped here:
* `LanguageModule.setup_embeddings_and_output_layer` moves the tied output weight to CUDA with
  `Tensor.cuda()` before all-reducing it across the embedding group (tied embeddings under
  PP > 1); on CPU we do that all-reduce in place.
* `DistributedOptimizer.__init__` sorts parameters by `Tensor.type()` strings, which name CUDA
  types only ('torch.cuda.FloatTensor', 'torch.cuda.BFloat16Tensor') and refuse anything else;
  it is built with host float tensors answering their CUDA type names (the dtype is what it
  asks; where the tensor lives it never reads there). `type()` is a method of every tensor, so
  this one cannot be scoped to a module: it is swapped for the constructor's duration only.
When a new megatron code path trips over CUDA, add its module to `_PATCHED_MODULES` (and a test
that exercises it).

Not covered (and not used by the trainer on CPU): megatron's `clip_grads` (`trainer.optim`
computes the grad norm instead), its optimizer's `step()` (the trainer runs the steps around
the norm itself), fused kernels, Transformer Engine.

`apply()` is idempotent and does nothing when CUDA is available: on GPUs megatron runs untouched.
"""

from __future__ import annotations

import importlib
import types

import torch

import collectives
from trainer import device_choice

# Modules whose module-level `torch` gets the CPU stand-in. Each is here because it calls
# `torch.cuda.*` or allocates on "cuda" in a code path the trainer uses.
_PATCHED_MODULES = (
    "megatron.core.tensor_parallel.mappings",  # TP all-gather output buffers
    "megatron.core.tensor_parallel.layers",  # linear layers' gather buffers
    "megatron.core.tensor_parallel.utils",  # split/gather helpers
    "megatron.core.utils",  # GlobalMemoryBuffer
    "megatron.core.models.common.embeddings.rotary_pos_embedding",  # inv_freq placement
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.transformer.attention",
    "megatron.core.transformer.transformer_layer",
    "megatron.core.pipeline_parallel.schedules",  # device="cuda" token counter
    "megatron.core.pipeline_parallel.p2p_communication",  # shape buffers, synchronize
    "megatron.core.distributed.param_and_grad_buffer",  # DDP grad buffers
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.optimizer.optimizer",  # mixed-precision optimizer's flags on "cuda"
    "megatron.core.optimizer.distrib_optimizer",  # buffers on current_device()
    "megatron.core.transformer.moe.router",  # router weight moved to current_device()
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.token_dispatcher",
)

_FACTORIES = ("empty", "zeros", "ones", "full", "tensor", "arange", "empty_like", "zeros_like")


def _cpu_device(device):
    if device is None:
        return None
    if isinstance(device, int) or (isinstance(device, str) and device.startswith("cuda")):
        return "cpu"
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CpuCuda(types.SimpleNamespace):
    """`torch.cuda` as seen by a patched megatron module on a CPU-only machine."""

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def synchronize(*_args, **_kwargs):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def is_available():
        return False

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class _CpuTorch(types.ModuleType):
    """The `torch` module as seen by a patched megatron module on a CPU-only machine."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        attr = getattr(torch, name)
        if name in _FACTORIES:

            def factory(*args, _f=attr, **kwargs):
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return _f(*args, **kwargs)

            return factory
        return attr


_CPU_TORCH = _CpuTorch()
_applied = False


def needed() -> bool:
    """The trainer computes on the CPU (`device_choice`: no CUDA, or the launcher chose the CPU
    on a machine that has it)."""
    return device_choice.current().type != "cuda"


def apply() -> bool:
    """Install the CPU stand-ins into megatron-core; returns True when it did (no CUDA)."""
    global _applied
    if not needed():
        return False
    if _applied:
        return True
    for name in _PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "torch", None) is torch:
            module.torch = _CPU_TORCH
    _wrap_tied_embedding_setup()
    _wrap_distributed_optimizer_init()
    _applied = True
    return True


def _wrap_tied_embedding_setup() -> None:
    from megatron.core.models.common.language_module import language_module as lm

    original = lm.LanguageModule.setup_embeddings_and_output_layer

    def setup_embeddings_and_output_layer(self):
        # Run megatron's version with torch.distributed looking uninitialized, so it skips its
        # `.cuda()` + all-reduce, then do that all-reduce on CPU ourselves. The warning it would
        # print for an uninitialized world does not apply, so it is silenced for this call.
        saved_torch = lm.torch
        saved_flag = getattr(lm.LanguageModule, "embedding_warning_printed", False)
        lm.torch = _NoDistTorch()
        lm.LanguageModule.embedding_warning_printed = True
        try:
            original(self)
        finally:
            lm.torch = saved_torch
            lm.LanguageModule.embedding_warning_printed = saved_flag
        tied_pp = (
            self.share_embeddings_and_output_weights
            and self.config.pipeline_model_parallel_size > 1
        )
        if tied_pp and torch.distributed.is_initialized() and self._is_in_embd_group():
            collectives.all_reduce(
                self.shared_embedding_or_output_weight().data, group=self.embd_group
            )

    lm.LanguageModule.setup_embeddings_and_output_layer = setup_embeddings_and_output_layer


# host tensor types -> the CUDA type names megatron's DistributedOptimizer sorts by
_CUDA_TYPE_NAMES = {
    "torch.FloatTensor": "torch.cuda.FloatTensor",
    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor",
    "torch.HalfTensor": "torch.cuda.HalfTensor",
}


def _wrap_distributed_optimizer_init() -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    original = DistributedOptimizer.__init__
    real_type = torch.Tensor.type

    def cuda_type_name(self, *args, **kwargs):
        name = real_type(self, *args, **kwargs)
        return _CUDA_TYPE_NAMES.get(name, name) if not args and not kwargs else name

    def __init__(self, *args, **kwargs):
        torch.Tensor.type = cuda_type_name
        try:
            original(self, *args, **kwargs)
        finally:
            torch.Tensor.type = real_type

    DistributedOptimizer.__init__ = __init__


class _NoDistTorch(types.ModuleType):
    def __init__(self):
        super().__init__("torch")
        self.distributed = types.SimpleNamespace(is_initialized=lambda: False)

    def __getattr__(self, name):
        return getattr(torch, name)
