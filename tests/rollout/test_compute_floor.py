"""The compute floor's FLOP count against torch's own FLOP counter on HF transformers' Qwen2
(`torch.utils.flop_counter.FlopCounterMode` counts every matmul the model runs)."""

import torch
import transformers
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.compute_floor import Model, gemm_rate, workload_flops

from tiny_hf import FAMILIES, make_hf_model

MODEL = Model(**{field: FAMILIES["qwen2"][key] for field, key in Model.CONFIG_KEYS.items()})


def _hf(attn_implementation: str):
    return make_hf_model("qwen2", attn_implementation=attn_implementation)


def _counted(model, ids: torch.Tensor, **kwargs) -> int:
    """FLOPs torch counts for one forward of `model` on `ids`."""
    with FlopCounterMode(display=False) as counter:
        model(ids, **kwargs)
    return counter.get_total_flops()


@torch.no_grad()
def test_prefill_and_decode_flops_equal_torch_flop_counter():
    prompt_len, new_tokens = 12, 5
    ids = torch.randint(0, MODEL.vocab, (1, prompt_len))
    # Eager attention runs as counted matmuls (SDPA's CPU kernel is not counted). Its prefill
    # scores the full square (masked), so causal attention is counted one query at a time: the
    # prompt fed token by token, then the decode steps, each against every earlier position.
    sdpa = _hf("sdpa")
    prefill = _counted(sdpa, ids, logits_to_keep=1)
    eager = _hf("eager")
    cache = transformers.DynamicCache(config=eager.config)
    by_token = [_counted(eager, ids[:, p : p + 1], cache=cache) for p in range(prompt_len)]
    tokens = torch.randint(0, MODEL.vocab, (new_tokens - 1, 1, 1))
    steps = [_counted(eager, token, cache=cache) for token in tokens]

    n = 3
    flops = workload_flops(MODEL, prompts=2, prompt_len=prompt_len, new_tokens=new_tokens, n=n)
    assert flops["prefill_linear"] + 2 * MODEL.head_flops() == 2 * prefill
    assert flops["decode_linear"] + flops["decode_attention"] + flops["lm_head"] - (
        2 * MODEL.head_flops()
    ) == 2 * n * sum(steps)
    # each fed token also ran the head, which a prefill runs on its last position only
    assert flops["prefill_linear"] + flops["prefill_attention"] == 2 * (
        sum(by_token) - prompt_len * MODEL.head_flops()
    )
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total")


def test_gemm_rate_is_a_positive_flop_rate():
    rate = gemm_rate(MODEL, "float32", threads=1, rows=64, repeats=2)
    assert 1e6 < rate < 1e14
