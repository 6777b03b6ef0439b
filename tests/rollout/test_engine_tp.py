"""Engine tensor parallelism: one replica over 2 CPU processes (gloo) against TP=1 and
HF transformers on the same weights.

One spawn of 2 ranks (file rendezvous, time-bounded) runs one scenario script for every family
(Qwen2: QKV bias, untied; Qwen3: q/k-norm, tied embeddings; Llama: llama3 RoPE, 8 heads over 2
KV heads) in float32 and float64; the vocabularies (97, 101, 89) are odd, so the last vocabulary
shard is the short one. The parent runs the same script on a TP=1 engine and checks:

* greedy tokens equal TP=1 and are HF's argmax at every step where HF's top-1 / top-2 gap is
  decisive; every logprob equals HF's log_softmax (teacher-forced over the sequence) and TP=1's
  within 1e-5 (float32) / 1e-10 (float64). The float64 reference is HF made float64 throughout
  (`exact_float64`: HF keeps its norms and rotary angles in float32); that covers the default
  RoPE only, so Llama's llama3 RoPE is held to 1e-10 against TP=1 and to 1e-5 against HF;
* seeded sampling (temperature, top-k, top-p; n=3, sample j uses generator seed + j) equals TP=1
  token for token;
* several requests with a shared prefix and n=2 run batched: prefix-cache hits equal TP=1's and
  are non-zero (the forks' partial last page is copied on every rank);
* a bad update raises (every rank stays in step); update_weights with full HF tensors of
  another model: outputs follow (equal TP=1 after the same
  update, differ from before); release_memory(weights=True), then resume_weights /
  update_weights back to the original weights / alloc_kv (the colocated order) reproduce the
  first outputs;
* every rank's release ends in the device allocator's release hook.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from exact_float64 import exact_float64
from safetensors.torch import load_file
from two_ranks import join_world, run_two_ranks

from rollout import Engine, EngineConfig, SamplingParams
from rollout.parallel_layers import check_divisible

from tiny_hf import FAMILIES, make_hf_model, save_hf_model

DTYPES = {"float32": (torch.float32, 1e-5), "float64": (torch.float64, 1e-10)}
CASES = [(family, dtype) for family in FAMILIES for dtype in DTYPES]
PREFIX = [3, 17, 5, 29, 11, 7, 23]  # 7 tokens: with page_size 4, forks copy a partial page
PROMPTS = [PREFIX + [2, 41], PREFIX + [13], PREFIX + [31, 19, 37], [43, 8, 61]]
GREEDY = SamplingParams(temperature=0.0, n=2, max_new_tokens=8, ignore_eos=True)
SAMPLED = SamplingParams(
    temperature=0.9, top_k=20, top_p=0.95, n=3, seed=11, max_new_tokens=8, ignore_eos=True
)
DEADLINE_S = 900


def _config(directory: str, dtype: str, tp: int) -> EngineConfig:
    return EngineConfig(model_path=directory, dtype=dtype, kv_cache_tokens=512, page_size=4, tp=tp)


def _outputs(engine: Engine, prompts, params) -> list[list[tuple[list[int], list[float]]]]:
    return [[(s.token_ids, s.logprobs) for s in out] for out in engine.generate(prompts, params)]


def scenarios(engine: Engine, directory: str, other_directory: str) -> dict:
    """The same calls on any engine; returns plain outputs to compare."""
    result = {"greedy": _outputs(engine, PROMPTS, GREEDY)}
    result["hits"] = engine.stats()["prefix_cache_hit_tokens"]
    result["sampled"] = _outputs(engine, PROMPTS[:2], SAMPLED)
    # A bad update raises on rank 0 (the other ranks fail on the same tensor and keep serving);
    # generation then waits for a complete set, which the next update brings.
    with pytest.raises(ValueError, match="has no parameter in this model"):
        engine.update_weights([("model.no_such.weight", torch.zeros(1))])
    engine.update_weights(load_file(str(Path(other_directory) / "model.safetensors")).items())
    result["updated"] = _outputs(engine, PROMPTS, GREEDY)
    engine.release_memory(weights=True)
    # the colocated order: the weights back, the push, then the KV pool (sized again)
    engine.resume_weights()
    engine.update_weights(load_file(str(Path(directory) / "model.safetensors")).items())
    engine.alloc_kv()
    result["resumed"] = _outputs(engine, PROMPTS, GREEDY)
    return result


def _rank(rank: int, rendezvous: str, dirs: dict, out_dir: str) -> None:
    import torch.distributed as dist

    from rollout import device_memory
    from rollout.tp_follower import run_rank

    torch.set_num_threads(1)
    returned, return_freed = [], device_memory.return_freed  # counted, and still run

    def counting(device):
        returned.append(str(device))
        return_freed(device)

    device_memory.return_freed = counting
    join_world(rank, rendezvous)
    for (family, dtype), (directory, other) in dirs.items():
        engine = run_rank(_config(directory, dtype, tp=2))
        if engine is not None:
            result = scenarios(engine, directory, other)
            engine.check_integrity()
            engine.close()
            torch.save(result, Path(out_dir) / f"{family}_{dtype}.pt")
    dist.destroy_process_group()
    torch.save(returned, Path(out_dir) / f"rank{rank}_returned.pt")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """(family, dtype) -> (HF model, its directory, directory of a second model of that config)."""
    made = {}
    for family, dtype in CASES:
        torch_dtype = DTYPES[dtype][0]
        model = make_hf_model(family, seed=0, dtype=torch_dtype)
        directory = save_hf_model(model, tmp_path_factory.mktemp(f"tp_{family}_{dtype}"))
        if dtype == "float64" and family != "llama":
            model = exact_float64(model)
        other = save_hf_model(
            make_hf_model(family, seed=1, dtype=torch_dtype),
            tmp_path_factory.mktemp(f"tp_{family}_{dtype}_other"),
        )
        made[family, dtype] = (model, str(directory), str(other))
    return made


@pytest.fixture(scope="module")
def tp2_results(checkpoints, tmp_path_factory) -> dict:
    out_dir = tmp_path_factory.mktemp("tp2_results")
    dirs = {case: (d, other) for case, (_, d, other) in checkpoints.items()}
    run_two_ranks(_rank, (dirs, str(out_dir)), out_dir, DEADLINE_S)
    results = {case: torch.load(out_dir / f"{case[0]}_{case[1]}.pt") for case in CASES}
    for rank in range(2):  # the devices each rank handed freed memory back to
        results["returned", rank] = torch.load(out_dir / f"rank{rank}_returned.pt")
    return results


@pytest.fixture(autouse=True)
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _check_against_hf(
    hf_model,
    prompt: list[int],
    tokens: list[int],
    logprobs: list[float],
    atol: float,
    margin: float,
) -> int:
    """Teacher-forced HF logits over prompt + completion: each token's logprob within `atol`, and
    each token is HF's argmax wherever HF's top-1 / top-2 gap exceeds `margin`. Returns the
    number of such decisive steps."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].to(torch.float64)
    reference = (
        torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
    )
    torch.testing.assert_close(
        torch.tensor(logprobs, dtype=torch.float64), reference, atol=atol, rtol=0
    )
    top2 = logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > margin
    assert torch.equal(torch.tensor(tokens)[decisive], logits.argmax(-1)[decisive])
    return int(decisive.sum())


def _assert_same(tp2, tp1, atol: float) -> None:
    for out2, out1 in zip(tp2, tp1, strict=True):
        for (tokens2, logprobs2), (tokens1, logprobs1) in zip(out2, out1, strict=True):
            assert tokens2 == tokens1
            torch.testing.assert_close(
                torch.tensor(logprobs2, dtype=torch.float64),
                torch.tensor(logprobs1, dtype=torch.float64),
                atol=atol,
                rtol=0,
            )


@pytest.mark.parametrize("family,dtype", CASES)
def test_tp2_equals_tp1_and_hf(family, dtype, checkpoints, tp2_results):
    hf_model, directory, other = checkpoints[family, dtype]
    atol = DTYPES[dtype][1]
    tp2 = tp2_results[family, dtype]
    tp1 = scenarios(Engine(_config(directory, dtype, tp=1)), directory, other)

    for name in ("greedy", "sampled", "updated", "resumed"):
        _assert_same(tp2[name], tp1[name], atol)
    hf_atol = DTYPES["float32"][1] if family == "llama" else atol
    decisive = sum(
        _check_against_hf(hf_model, prompt, tokens, logprobs, hf_atol, margin=100 * hf_atol)
        for prompt, samples in zip(PROMPTS, tp2["greedy"])
        for tokens, logprobs in samples
    )
    assert decisive >= 0.9 * len(PROMPTS) * GREEDY.n * GREEDY.max_new_tokens, (
        "reference not decisive"
    )
    # Shared prefix across requests and n=2 forks: the radix cache hits, as at TP=1.
    assert tp2["hits"] == tp1["hits"] > 0
    # Weights changed: outputs follow; back to the original weights after release: outputs return.
    assert [s[0] for o in tp2["updated"] for s in o] != [s[0] for o in tp2["greedy"] for s in o]
    _assert_same(tp2["resumed"], tp2["greedy"], 0.0)


def test_every_rank_hands_released_memory_back(tp2_results):
    """Each `release_memory` ends in the allocator's release hook on rank 0 and on the follower
    (`device_memory.return_freed`; on CUDA it empties torch's cache in each process)."""
    assert tp2_results["returned", 0] == tp2_results["returned", 1] == ["cpu"] * len(CASES)


def test_tp_refusals_are_one_line():
    for overrides, field in (
        ({"attention_backend": "triton", "device": "cuda"}, "attention_backend"),
        ({"decode_graphs": True}, "decode_graphs"),
        ({"speculative_method": "ngram"}, "speculative_method"),
        ({"tp": 0}, "tp"),
    ):
        overrides.setdefault("tp", 2)
        with pytest.raises(ValueError, match=f"EngineConfig.{field}=") as error:
            EngineConfig(model_path="m", **overrides)
        assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="must divide the model's num_key_value_heads=2; choose"):
        check_divisible(num_heads=8, num_kv_heads=2, intermediate_size=160, tp_size=4)
    with pytest.raises(ValueError, match="must divide the model's intermediate_size=90"):
        check_divisible(num_heads=4, num_kv_heads=4, intermediate_size=90, tp_size=4)
    # without a group of the right size (earlier tests in this process may have made a world of 1)
    if torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="the Engine is rank 0 of a group of that size, got"):
            Engine(EngineConfig(model_path="m", tp=2))
    else:
        with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
            Engine(EngineConfig(model_path="m", tp=2))
