"""The mixture-of-experts engine's reference checks, shared by the TP=1 and TP=2 tests: HF
transformers teacher-forced over prompt + completion with `output_router_logits=True`, and the
comparison of two engines' outputs (tokens, log-probs, routes)."""

from __future__ import annotations

import torch
from exact_float64 import exact_float64

from rollout import Engine, SamplingParams
from rollout.sequence import RequestOutput

from tiny_hf import MOE_FAMILIES, make_hf_model, save_hf_model

DTYPES = {"float32": (torch.float32, 1e-5), "float64": (torch.float64, 1e-10)}
CASES = [(family, dtype) for family in MOE_FAMILIES for dtype in DTYPES]
PREFIX = [3, 17, 5, 29, 11, 7, 23]  # 7 tokens: with page_size 4, forks copy a partial page
PROMPTS = [PREFIX + [2, 41], PREFIX + [13], PREFIX + [31, 19, 37], [43, 8, 61, 4, 9]]
GREEDY = SamplingParams(temperature=0.0, n=2, max_new_tokens=10, ignore_eos=True)
ROUTE_MARGIN = 1e-4  # float32: router-logit gap from which HF's top-k is taken as decisive


def make_checkpoints(tmp_path_factory) -> dict:
    """(family, dtype) -> (HF reference model, its directory, a second model's directory)."""
    made = {}
    for family, dtype in CASES:
        torch_dtype = DTYPES[dtype][0]
        model = make_hf_model(family, seed=0, dtype=torch_dtype)
        directory = save_hf_model(model, tmp_path_factory.mktemp(f"{family}_{dtype}"))
        other = save_hf_model(
            make_hf_model(family, seed=1, dtype=torch_dtype),
            tmp_path_factory.mktemp(f"{family}_{dtype}_other"),
        )
        if dtype == "float64":
            model = exact_float64(model)
        made[family, dtype] = (model, str(directory), str(other))
    return made


def run(engine: Engine, prompts, params: SamplingParams) -> list[RequestOutput]:
    """Every prompt's RequestOutput, in prompt order."""
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[int, RequestOutput] = {}
    while engine.has_unfinished():
        done.update((out.request_id, out) for out in engine.step())
    engine.check_integrity()
    return [done[i] for i in ids]


@torch.inference_mode()
def hf_reference(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """HF teacher-forced over `ids`: (logits [T, V] float64, top-k expert ids [T, layers, k],
    the k-th minus (k+1)-th router logit [T, layers])."""
    out = model(torch.tensor([ids]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    router = torch.stack(out.router_logits, dim=1).double()  # [T, layers, E]
    top = router.topk(k + 1, dim=-1)
    gap = top.values[..., k - 1] - top.values[..., k]
    return out.logits[0].double(), top.indices[..., :k], gap


def check_against_hf(hf_model, prompt, out: RequestOutput, dtype: str) -> None:
    """Every sample of `out`: tokens, log-probs and routes against HF (module docstring)."""
    atol = DTYPES[dtype][1]
    assert out.routed_experts is not None and len(out.routed_experts) == len(out.samples)
    for sample, routes in zip(out.samples, out.routed_experts, strict=True):
        ids = list(prompt) + list(sample.token_ids)
        logits, top_k, gap = hf_reference(hf_model, ids)
        step_logits = logits[len(prompt) - 1 : -1]
        completion = torch.tensor(sample.token_ids)
        reference = torch.log_softmax(step_logits, -1).gather(-1, completion[:, None])[:, 0]
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64), reference, atol=atol, rtol=0
        )
        top2 = step_logits.topk(2, dim=-1).values
        assert bool(((top2[:, 0] - top2[:, 1]) > 100 * atol).all()), "reference not decisive"
        assert torch.equal(completion, step_logits.argmax(-1)), "greedy tokens differ from HF's"

        assert routes.shape == (len(ids) - 1, *top_k.shape[1:])
        assert routes.dtype == torch.uint8  # at most 256 experts
        expected = top_k[: len(ids) - 1]
        if dtype == "float64":
            assert torch.equal(routes.long(), expected)
        else:
            decisive = gap[: len(ids) - 1] > ROUTE_MARGIN
            assert decisive.float().mean() >= 0.99, "router reference not decisive"
            assert torch.equal(routes.long()[decisive], expected[decisive])


def assert_same(a: list[RequestOutput], b: list[RequestOutput], atol: float = 0.0) -> None:
    """Token for token, log-probs within `atol`, routes bitwise."""
    for x, y in zip(a, b, strict=True):
        for sx, sy in zip(x.samples, y.samples, strict=True):
            assert sx.token_ids == sy.token_ids
            torch.testing.assert_close(
                torch.tensor(sx.logprobs, dtype=torch.float64),
                torch.tensor(sy.logprobs, dtype=torch.float64),
                atol=atol,
                rtol=0,
            )
        for rx, ry in zip(x.routed_experts, y.routed_experts, strict=True):
            assert torch.equal(rx, ry)
