"""Decode graphs (static-shape decode steps, CUDA graphs on a GPU) against the dynamic path.

Two engines on the same float32 weights (head_dim 128, Triton attention), one with graphs and
one without; greedy samples must be identical and log-probs within 1e-4:
1. as loaded (the graphs are captured);
2. after an in-place `update_weights` to other weights in both: the captured graphs are
   replayed, not captured again (the same graph objects), and read the new weights;
3. after `release_memory(weights=True)` -> `resume_memory()` -> `update_weights` in the graph
   engine: whether its graphs were re-captured is reported with the first rollout's seconds
   against a warm one's (re-capture is the price of releasing the parameters).
The dry run runs the same static-shape steps eagerly on CPU (torch attention).
"""

from __future__ import annotations

import time

import torch

from benchmarks.gpu_suite import models

LOGPROB_TOL = 1e-4


def captured_graphs(engine) -> dict[int, int]:
    """{bucket size: id of its captured graph}. Reads the graphs' table, which has no public
    accessor: the one way to tell a replay from a fresh capture."""
    static = getattr(engine.decode_graphs, "_static", {})
    return {size: id(s.graph) for size, s in static.items() if s.graph is not None}


def run(ctx) -> dict:
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.weights import iter_safetensors

    tiny = ctx.dry_run
    preset = "tiny" if tiny else "hd128"
    first = models.checkpoint(ctx.workdir, preset, std=0.1, seed=0)
    second = models.checkpoint(ctx.workdir, preset, std=0.1, seed=1)
    if ctx.cuda:
        torch.backends.cuda.matmul.allow_tf32 = False

    def engine(graphs: bool):
        return Engine(
            EngineConfig(
                model_path=first,
                device=ctx.device,
                attention_backend="torch" if tiny else "triton",
                decode_graphs=graphs,
                max_model_len=256,
                kv_cache_tokens=8192,
                max_running_requests=32,
            )
        )

    eager, graphs = engine(False), engine(True)
    prompts = models.random_prompts(models.PRESETS[preset]["vocab_size"], 12, 4, 40, seed=7)
    params = SamplingParams(n=2, temperature=0.0, max_new_tokens=32, ignore_eos=True)

    def compare(stage: str):
        replays = graphs.decode_graphs.replays
        want = [s for per in eager.generate(prompts, params) for s in per]
        start = time.perf_counter()
        got = [s for per in graphs.generate(prompts, params) for s in per]
        seconds = time.perf_counter() - start
        same = sum(a.token_ids == b.token_ids for a, b in zip(got, want))
        diff = max(abs(x - y) for a, b in zip(got, want) for x, y in zip(a.logprobs, b.logprobs))
        static_steps = graphs.decode_graphs.replays - replays
        ctx.check(
            f"graphs_equal_eager_{stage}",
            same == len(want) and diff <= LOGPROB_TOL and static_steps > 0,
            identical_samples=same,
            samples=len(want),
            max_logprob_diff=diff,
            static_steps=static_steps,
        )
        return [a.token_ids for a in got], seconds

    tokens_first, first_s = compare("as_loaded")
    captured = captured_graphs(graphs)
    update = dict(iter_safetensors(second))
    eager.update_weights(update.items())
    graphs.update_weights(update.items())
    tokens_second, warm_s = compare("after_update")
    ctx.check("update_changed_outputs", tokens_second != tokens_first)
    if ctx.cuda:
        kept = captured_graphs(graphs)
        ctx.check(
            "update_replays_captured_graphs",
            bool(captured) and all(kept.get(size) == g for size, g in captured.items()),
            captured_buckets=sorted(captured),
        )

    graphs.release_memory(weights=True)
    graphs.resume_memory()
    graphs.update_weights(update.items())
    _, resumed_s = compare("after_release_resume")
    after = captured_graphs(graphs)
    return {
        "model": preset,
        "captured": ctx.cuda,
        "first_rollout_s": round(first_s, 3),
        "warm_rollout_s": round(warm_s, 3),
        "after_resume_rollout_s": round(resumed_s, 3),
        "recaptured_after_resume": ctx.cuda and any(after.get(s) != g for s, g in captured.items()),
    }
