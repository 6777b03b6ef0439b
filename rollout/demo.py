"""Generation demo: a tiny random Qwen2-shaped model, a GRPO-shaped batch, throughput and cache stats.

    python -m rollout.demo [--prompts 8] [--n 8] [--prompt-len 64] [--max-new-tokens 64]

Random weights produce random tokens: the demo shows the engine's mechanics (one prefill per
prompt shared by its n samples, continuous batching, logprobs), not text.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(model_dir, TINY_QWEN2, seed=0, std=0.15)
        pool = args.prompts * args.n * (args.prompt_len + args.max_new_tokens)
        engine = Engine(EngineConfig(model_path=model_dir, kv_cache_tokens=pool))
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(1, TINY_QWEN2["vocab_size"], (args.prompts, args.prompt_len), generator=g).tolist()
        params = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens, seed=0)
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - start
    stats = engine.stats()
    generated = sum(len(s.token_ids) for per_prompt in outs for s in per_prompt)
    print(f"{args.prompts} prompts x n={args.n}: {generated} tokens in {seconds:.2f}s "
          f"({generated / seconds:.0f} tokens/s)")
    print(f"prompt tokens computed: {stats['prefill_tokens_computed']} "
          f"(sum of prompt lengths {args.prompts * args.prompt_len}); "
          f"reused from the prefix cache: {stats['prefix_cache_hit_tokens']}")
    first = outs[0][0]
    print(f"prompt 0, sample 0: {first.token_ids[:12]}... finish_reason={first.finish_reason}")
    print(f"  logprobs: {[round(x, 3) for x in first.logprobs[:6]]}...")


if __name__ == "__main__":
    main()
