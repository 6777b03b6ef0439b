"""One engine, ours or vLLM's, kept loaded in its own process for `benchmarks/vs_vllm.py`.

Runs under the project's environment (`--engine ours`) or `.venv-vllm/` (`--engine vllm`), so it
imports nothing of the project at module level. Protocol, one JSON object a line: the worker
loads the model, warms it up (compilation included) and prints `@@READY {...}`; then for each
line on stdin `{"prompts": [[token ids]], "n": N, "new_tokens": K}` it generates n samples of
exactly K tokens per prompt (sampled at T = 1, EOS ignored) and prints `@@RESULT {"seconds",
"generated", "full"}`; an empty line or end of input ends it. Library logs may share stdout: the
parent reads only the `@@` lines.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WARM_PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10] * 4, [11, 12, 13, 14, 15, 16, 17, 18] * 4]


def say(tag: str, payload: dict) -> None:
    sys.stdout.write(f"@@{tag} {json.dumps(payload)}\n")
    sys.stdout.flush()


class OursRunner:
    def __init__(self, args):
        import torch

        sys.path.insert(0, str(ROOT))
        from rollout import Engine, EngineConfig

        torch.set_num_threads(args.threads)
        self.engine = Engine(
            EngineConfig(
                model_path=args.model,
                dtype=args.dtype,
                kv_cache_tokens=args.kv_tokens,
                max_running_requests=256,
                enable_prefix_cache=args.prefix_cache,
                compile=args.compile,
                seed=0,
            )
        )
        self.setup = {
            "engine": "miles_like rollout.Engine",
            "page_size": self.engine.config.page_size,
            "compile": args.compile,
            "torch_threads": torch.get_num_threads(),
        }

    def generate(self, prompts, n, new_tokens):
        from rollout import SamplingParams

        params = SamplingParams(
            n=n, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=new_tokens, ignore_eos=True
        )
        t0 = time.perf_counter()
        outs = self.engine.generate(prompts, [params] * len(prompts))
        seconds = time.perf_counter() - t0
        lengths = [len(s.token_ids) for per_prompt in outs for s in per_prompt]
        return seconds, lengths


class VllmRunner:
    def __init__(self, args):
        import torch
        import vllm

        self.llm = vllm.LLM(
            model=args.model,
            dtype=args.dtype,
            block_size=args.block_size,
            enable_prefix_caching=args.prefix_cache,
            max_num_seqs=256,
            max_model_len=args.max_model_len,
            skip_tokenizer_init=True,
            seed=0,
            enforce_eager=not args.compile,
        )
        self.setup = {
            "engine": f"vllm {vllm.__version__}",
            "block_size": args.block_size,
            "compile": args.compile,
            "enforce_eager": not args.compile,
            "torch_threads": torch.get_num_threads(),
            "env": {
                k: v
                for k, v in os.environ.items()
                if k.startswith(("VLLM_", "KMP_", "OMP_")) or k == "LD_PRELOAD"
            },
        }

    def generate(self, prompts, n, new_tokens):
        import vllm

        params = vllm.SamplingParams(
            n=n,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tokens=new_tokens,
            min_tokens=new_tokens,
            ignore_eos=True,
            detokenize=False,
        )
        inputs = [{"prompt_token_ids": p} for p in prompts]
        t0 = time.perf_counter()
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        lengths = [len(c.token_ids) for o in outs for c in o.outputs]
        return seconds, lengths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("ours", "vllm"), required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prefix-cache", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-tokens", type=int, default=None, help="ours: KV pool in tokens")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM: KV block in tokens")
    ap.add_argument("--max-model-len", type=int, default=1024)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    runner = (OursRunner if args.engine == "ours" else VllmRunner)(args)
    runner.generate(WARM_PROMPTS, 2, 8)  # warm-up (vLLM compiles while loading)
    say("READY", {"load_and_warmup_s": time.perf_counter() - t0, **runner.setup})
    for line in sys.stdin:
        if not line.strip():
            break
        job = json.loads(line)
        seconds, lengths = runner.generate(job["prompts"], job["n"], job["new_tokens"])
        full = len(lengths) == len(job["prompts"]) * job["n"] and all(
            x == job["new_tokens"] for x in lengths
        )
        say("RESULT", {"seconds": seconds, "generated": sum(lengths), "full": full})


if __name__ == "__main__":
    main()
