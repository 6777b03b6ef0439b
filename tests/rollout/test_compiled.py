"""The compiled forward (`EngineConfig.compile`, rollout/compiled.py) against the eager one it
replaces, on the same weights, in one process:

* qwen3 (q/k-norm, explicit head_dim, tied embeddings: every piece of the layer) in float32:
  greedy tokens equal and log-probs within 1e-5, sampled (T = 1, seeded) tokens equal and
  log-probs within 1e-5 (compiled code rounds differently: fused reductions and vectorised exp /
  rsqrt; the tokens are checked on these seeds);
* after a weight update (in-place copies the compiled code must see: a stale graph would keep
  the old weights and the outputs would not move with the eager engine's), and after
  `release_memory(weights=True)` / `resume_memory` + a full update: the same agreement, and not
  one graph compiled by either (guards check shapes and dtypes, not addresses);
* at most two graphs per piece (dynamic sizes, plus the one-row specialisation);
* float64: the same checks within 1e-12 (inductor's C++ backend computes float64 natively).
Compiling is slow on a shared CPU (a minute or more cold for the three pieces; inductor's
on-disk cache makes reruns faster), hence one test per dtype covering every case.
"""

import itertools

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.compiled import compiled_graphs


def prompts_for(vocab: int, count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab, (int(n),), generator=g).tolist()
        for n in torch.randint(1, 24, (count,), generator=g)
    ]


def agree(eager, compiled, bound: float) -> None:
    for a, b in zip(itertools.chain(*eager), itertools.chain(*compiled)):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= bound


def perturbed(engine: Engine, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    return [
        (name, (p.detach().cpu() + 0.05 * torch.randn(p.shape, generator=g)).to(dtype))
        for name, p in engine.model.named_parameters()
    ]


@pytest.mark.parametrize("dtype, bound", [("float32", 1e-5), ("float64", 1e-12)])
def test_compiled_engine_equals_eager(tiny_hf_checkpoints, dtype, bound):
    model, directory = tiny_hf_checkpoints("qwen3")
    prompts = prompts_for(model.config.vocab_size, 4)
    config = dict(model_path=str(directory), page_size=4, max_model_len=96, dtype=dtype)
    eager = Engine(EngineConfig(**config))
    compiled = Engine(EngineConfig(**config, compile=True))
    greedy = SamplingParams(n=3, temperature=0.0, max_new_tokens=12, ignore_eos=True)
    sampled = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=7)

    def check() -> None:
        for params in (greedy, sampled):
            agree(eager.generate(prompts, params), compiled.generate(prompts, params), bound)
        compiled.check_integrity()

    start = compiled_graphs()  # process-wide: other tests compile too
    check()  # compiles: prefill of several tokens, decode batches of several rows
    before = compiled.generate(prompts[:1], greedy)[0][0].token_ids  # compiles one-row logits
    graphs = compiled_graphs()
    assert 3 <= graphs - start <= 2 * 3  # each piece at most twice: any size >= 2, and size 1

    update = perturbed(eager, seed=1, dtype=getattr(torch, dtype))
    for engine in (eager, compiled):
        engine.update_weights(update)
    assert compiled.generate(prompts[:1], greedy)[0][0].token_ids != before  # weights moved
    check()

    update = perturbed(eager, seed=2, dtype=getattr(torch, dtype))
    for engine in (eager, compiled):
        engine.release_memory(weights=True)
        engine.resume_memory()
        engine.update_weights(update)
    check()
    assert compiled_graphs() == graphs  # nothing recompiled for new weights or storage


def test_compile_is_refused_under_tensor_parallelism():
    with pytest.raises(ValueError, match="EngineConfig.compile=True is not supported"):
        EngineConfig(model_path="unused", tp=2, compile=True)
