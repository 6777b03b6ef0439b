"""`trainer.megatron_import`: megatron-core imported with its `jit_fuser` compiling on first call.

Each check runs in a fresh interpreter (megatron is imported once per process). The import must
not load inductor, which a plain `import megatron.core` does through `torch.compile`; megatron's
fused SwiGLU must still be torch.compile'd code when it runs (dynamo compiles a graph at its
first call) and compute SiLU(y1) * y2 as torch's eager ops do; and `TrainerConfig.compile`'s
swap (`compile_swiglu`) must find the eager function under the deferred wrapper.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_fresh(code: str) -> str:
    proc = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", textwrap.dedent(code)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_plain_import_loads_inductor_and_the_deferred_one_does_not():
    loaded = "print('torch._inductor.compile_fx' in sys.modules)"
    plain = run_fresh(f"import sys, megatron.core\n{loaded}")
    deferred = run_fresh(
        "import sys\n"
        "from trainer.megatron_import import import_megatron_core\n"
        f"import_megatron_core()\n{loaded}"
    )
    assert plain.split() == ["True"] and deferred.split() == ["False"]


def test_deferred_fusion_is_compiled_at_first_call_and_equals_eager():
    out = run_fresh(
        """
        import inspect, sys
        import torch
        import torch.nn.functional as F
        from trainer.megatron_import import import_megatron_core
        import_megatron_core()
        from megatron.core.fusions import fused_bias_swiglu as fused
        from torch._dynamo.utils import counters
        before = int(counters["stats"]["unique_graphs"])
        y = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        got = fused.swiglu(y)
        want = F.silu(y[:, :4]) * y[:, 4:]
        print(int(counters["stats"]["unique_graphs"]) - before, (got - want).abs().max().item())
        eager = inspect.unwrap(fused.swiglu)
        from trainer.compiled import compile_swiglu
        compile_swiglu()
        print(fused.swiglu._torchdynamo_orig_callable is eager, eager is not fused.swiglu)
        """
    )
    graphs, diff, unwrapped, replaced = out.split()
    assert int(graphs) >= 1  # dynamo compiled it on that call
    assert float(diff) < 1e-12  # float64: fused loops round within a few ulps
    assert unwrapped == replaced == "True"
