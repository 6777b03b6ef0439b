"""Speculative decoding benchmark on a GRPO-shaped workload (CPU or GPU).

Same prompts, same engine settings, speculation off vs `ngram` vs `group` vs `draft` (and `group`
with the back-off disabled); reports generated tokens/s, the speedup over no speculation, and the
mean accepted length (tokens emitted per verifying sequence-step = 1 + accepted drafts / verify
steps). The draft model is the target's first `--draft-layers` layers with its embeddings, final
norm and LM head (layer-skip self-speculation): the one draft a random-init target has that
agrees with it at all.

Random-init weights are near-uniform at T = 1, so drafts are almost never accepted; a trained
RL policy is much sharper. `--weight-std` scales the random init to emulate that: the benchmark
reports the per-token entropy of the model's samples so the regime is explicit.

    python benchmarks/speculative.py [--prompts 16 --n 8 --prompt-len 64 --max-new-tokens 128]
                                     [--weight-std 0.02 0.5] [--k 4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors.torch import save_file  # noqa: E402

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from rollout import Engine, EngineConfig, SamplingParams  # noqa: E402
from rollout.random_checkpoint import QWEN25_05B, TINY_QWEN2, write_random_checkpoint  # noqa: E402
from rollout.weights import iter_safetensors  # noqa: E402

PRESETS = {"tiny": TINY_QWEN2, "qwen2.5-0.5b": QWEN25_05B}

# name -> EngineConfig overrides
METHODS = {
    "off": {},
    "ngram": dict(speculative_method="ngram"),
    "group": dict(speculative_method="group"),
    "group_no_backoff": dict(speculative_method="group", speculative_min_acceptance=0.0),
    "draft": dict(speculative_method="draft"),
}


def write_layer_skip_draft(target_dir: str, draft_dir: str, num_layers: int) -> str:
    """The target's first `num_layers` decoder layers, embeddings, final norm and LM head."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    tensors = {
        name: t
        for name, t in iter_safetensors(target_dir)
        if not name.startswith("model.layers.") or int(name.split(".")[2]) < num_layers
    }
    Path(draft_dir).mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(Path(draft_dir) / "model.safetensors"))
    (Path(draft_dir) / "config.json").write_text(
        json.dumps({**config, "num_hidden_layers": num_layers})
    )
    return draft_dir


def run(model_dir: str, draft_dir: str, prompts, params: SamplingParams, method: str, args) -> dict:
    """The fastest of `--repeats` measurements, each on a fresh engine (see `run_once`)."""
    rows = [
        run_once(model_dir, draft_dir, prompts, params, method, args) for _ in range(args.repeats)
    ]
    return min(rows, key=lambda row: row["seconds"])


def run_once(
    model_dir: str, draft_dir: str, prompts, params: SamplingParams, method: str, args
) -> dict:
    """Two rollouts of the same prompts, as in consecutive RL epochs; the second is measured
    (for `group`, earlier completions of each prompt are then available as drafts)."""
    overrides = dict(METHODS[method])
    if method == "draft":
        overrides["speculative_draft_model_path"] = draft_dir
    engine = Engine(
        EngineConfig(
            model_path=model_dir,
            device=args.device,
            dtype=args.dtype,
            kv_cache_tokens=len(prompts)
            * params.n
            * (len(prompts[0]) + params.max_new_tokens + 64),
            num_speculative_tokens=args.k,
            speculative_ngram_min=2,
            **overrides,
        )
    )
    engine.generate(prompts, dataclasses.replace(params, seed=1))
    before = engine.stats()
    start = time.perf_counter()
    outs = engine.generate(prompts, params)  # returns Python lists: the device work is done
    seconds = time.perf_counter() - start
    stats = {
        key: engine.stats()[key] - before[key]
        for key in (
            "generated_tokens",
            "decode_steps",
            "spec_verify_steps",
            "spec_draft_tokens",
            "spec_accepted_tokens",
            "spec_backoff_steps",
        )
    }
    logprobs = [lp for per in outs for s in per for lp in s.logprobs]
    result = {
        "seconds": seconds,
        "tokens_per_s": stats["generated_tokens"] / seconds,
        "mean_token_nll": -sum(logprobs) / len(logprobs),
        **stats,
    }
    if stats["spec_verify_steps"]:
        result["accepted_length"] = 1 + stats["spec_accepted_tokens"] / stats["spec_verify_steps"]
        result["acceptance_rate"] = stats["spec_accepted_tokens"] / max(
            1, stats["spec_draft_tokens"]
        )
    return result


def main(argv=None) -> dict:
    record = RunRecord.start("speculative", argv)
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--preset",
        default="tiny",
        choices=sorted(PRESETS),
        help="model shape (random weights): tiny, or qwen2.5-0.5b for the GPU suite",
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--weight-std", type=float, nargs="+", default=[0.02, 1.0])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=1)
    parser.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="measurements per method, each on a fresh engine; the fastest is kept "
        "(the box is shared)",
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    add_output_args(parser)
    args = parser.parse_args(argv)
    config = PRESETS[args.preset]
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(
        1, config["vocab_size"], (args.prompts, args.prompt_len), generator=g
    ).tolist()
    params = SamplingParams(
        n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, ignore_eos=True, seed=0
    )
    workload = {k: v for k, v in vars(args).items() if k not in ("out", "save")}
    report = {"workload": workload, "torch_num_threads": torch.get_num_threads(), "models": {}}
    for std in args.weight_std:
        with tempfile.TemporaryDirectory() as model_dir, tempfile.TemporaryDirectory() as draft_dir:
            write_random_checkpoint(
                model_dir, config, seed=0, std=std, dtype=getattr(torch, args.dtype)
            )
            write_layer_skip_draft(model_dir, draft_dir, args.draft_layers)
            methods = ["off"] + [m for m in args.methods if m != "off"]  # the baseline always runs
            rows = {m: run(model_dir, draft_dir, prompts, params, m, args) for m in methods}
        base = rows["off"]["tokens_per_s"]
        for row in rows.values():
            row["speedup"] = row["tokens_per_s"] / base
        report["models"][f"weight_std={std}"] = rows
    record.finish(report, args)
    return report


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
