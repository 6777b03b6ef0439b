"""Training throughput: megatron backend vs DeepSpeed backend vs plain HF, same model and batch.

One process, world size 1, fp32 on CPU (or GPU when present). A random-init Qwen2-architecture
model is built with HF transformers and saved to a temporary directory; both backends load it,
then run PPO train steps (the first update of an on-policy rollout: old log-probs from the
update's own forward, forward/backward, AdamW) on the same fixed batch of B samples (prompt P +
response R tokens, packed into micro-batches of at most `--micro-batch-tokens` tokens).

`hf` is the baseline: plain HF transformers on the same weights, the whole batch as one padded
[B, P + R] forward, log-softmax of the response tokens, the same PPO loss at ratio 1, backward,
grad-norm clipping and torch AdamW - the simplest correct train step.

    .venv/bin/python benchmarks/train_throughput.py            # default workload
    .venv/bin/python benchmarks/train_throughput.py --rl       # 8 prompts x 8 samples x 256 tokens
    .venv/bin/python benchmarks/train_throughput.py --quick    # seconds; used by a smoke test
    .venv/bin/python benchmarks/train_throughput.py --rl --backends megatron,megatron_compiled,hf

`megatron_compiled` is the megatron backend with `TrainerConfig.compile` (`trainer.compile`):
its compiling happens in the untimed warm-up step, reported per contender as `warmup_step_s`
(set TORCHINDUCTOR_CACHE_DIR to a fresh directory for a cold compile).

Prints one JSON object: per contender, steps timed, median and min seconds per step, and
training tokens/s (batch tokens per step / median seconds per step), plus the megatron (and
megatron_compiled) / deepspeed and / hf ratios. Steps of the contenders alternate, so
background load on a shared machine hits them alike.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402


def build_model(directory: Path, args) -> None:
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or max(1, args.heads // 2),
        vocab_size=args.vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory, safe_serialization=True)


def make_batch(args):
    from trainer.config import RLBatch

    g = torch.Generator().manual_seed(0)
    if args.batch % args.group_size:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --group-size")
    tokens = []
    for _ in range(args.batch // args.group_size):  # a GRPO group: one prompt, several samples
        prompt = torch.randint(0, args.vocab, (args.prompt,), generator=g).tolist()
        for _ in range(args.group_size):
            response = torch.randint(0, args.vocab, (args.response,), generator=g).tolist()
            tokens.append(prompt + response)
    advantages = [torch.randn(args.response, generator=g) for _ in range(args.batch)]
    return RLBatch(tokens=tokens, prompt_lens=[args.prompt] * args.batch, advantages=advantages)


class PlainHF:
    """The baseline train step: HF transformers, one padded forward over the whole batch (every
    sample is P + R tokens here, so nothing is padded), PPO at ratio 1, backward, clipping,
    AdamW. What a minimal RL trainer does; no packing, no fusion."""

    def __init__(self, model_path: str, lr: float, grad_clip: float = 1.0):
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_pretrained(
            model_path, dtype=torch.float32, attn_implementation="sdpa"
        )
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.grad_clip = grad_clip

    def train_step(self, batch) -> None:
        ids = torch.tensor(batch.tokens)
        p = batch.prompt_lens[0]
        logits = self.model(input_ids=ids).logits[:, p - 1 : -1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        lp = logp.gather(-1, ids[:, p:, None])[..., 0]
        adv = torch.stack(batch.advantages)
        ratio = torch.exp(lp - lp.detach())
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2)).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
        self.opt.step()


def measure(trainers: dict, batch, steps: int) -> dict:
    """Alternate one step of each backend, `steps` rounds after a warm-up round, and report the
    median step time: on a shared machine, interleaving exposes both backends to the same
    background load."""
    import statistics

    times: dict[str, list[float]] = {name: [] for name in trainers}
    warmup: dict[str, float] = {}
    for round_ in range(steps + 1):
        for name, trainer in trainers.items():
            start = time.perf_counter()
            trainer.train_step(batch)
            if round_:  # round 0 warms up: allocations, Adam state, lazy kernels, compiling
                times[name].append(time.perf_counter() - start)
            else:
                warmup[name] = time.perf_counter() - start
    tokens = sum(len(t) for t in batch.tokens)
    out = {}
    for name, ts in times.items():
        per_step = statistics.median(ts)
        out[name] = {
            "steps": steps,
            "s_per_step_median": per_step,
            "s_per_step_min": min(ts),
            "s_per_step_all": [round(t, 3) for t in ts],
            "warmup_step_s": round(warmup[name], 3),  # with `megatron_compiled`: its compiling
            "tokens_per_step": tokens,
            "train_tokens_per_s": tokens / per_step,
        }
    return out


def main() -> None:
    record = RunRecord.start("train_throughput")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument(
        "--rl", action="store_true", help="an RL batch: 8 prompts x 8 samples x (128 + 128) tokens"
    )
    p.add_argument(
        "--backends",
        default="megatron,deepspeed,hf",
        help="of megatron, megatron_compiled (TrainerConfig.compile), deepspeed, hf",
    )
    p.add_argument("--kv-heads", type=int, default=0, help="0: heads / 2")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--response", type=int, default=192)
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=0,
        help="0: 2048 (default workload); the whole batch with --rl (HF's one padded forward)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=0,
        help="samples per prompt (a GRPO group); 0: 8 with --rl (8 prompts x 8 samples), else 1",
    )
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--threads", type=int, default=0)
    add_output_args(p)
    args = p.parse_args()
    if args.rl:
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab = 256, 4, 8, 2, 512
        args.batch, args.prompt, args.response = 64, 128, 128
        # one micro-batch, as plain HF's one forward: on CPU each op of each micro-batch is an
        # OpenMP parallel region, and fewer, larger ones hold up better on busy cores
        args.micro_batch_tokens = args.micro_batch_tokens or args.batch * (
            args.prompt + args.response
        )
    args.group_size = args.group_size or (8 if args.rl else 1)
    if args.quick:
        args.hidden, args.layers, args.heads, args.vocab = 64, 2, 4, 256
        args.batch, args.prompt, args.response, args.steps = 4, 8, 24, 2
        args.micro_batch_tokens = 64
    args.micro_batch_tokens = args.micro_batch_tokens or 2048
    if args.threads:
        torch.set_num_threads(args.threads)

    # Keep stdout pure JSON: DeepSpeed and megatron log to stdout while loading.
    with contextlib.redirect_stdout(sys.stderr):
        results = run(args)
    result = report(args, results)
    record.finish(result, args)
    print(json.dumps(result, indent=2))


def run(args) -> dict:
    from trainer.config import LossConfig, OptimConfig, TrainerConfig
    from trainer.deepspeed_trainer import DeepSpeedTrainer
    from trainer.megatron_trainer import MegatronTrainer

    with tempfile.TemporaryDirectory() as tmp:
        build_model(Path(tmp), args)
        batch = make_batch(args)
        trainers = {}
        chosen = args.backends.split(",")
        contenders = (
            ("megatron", MegatronTrainer, False),
            ("megatron_compiled", MegatronTrainer, True),
            ("deepspeed", DeepSpeedTrainer, False),
        )
        for name, cls, compiled in contenders:
            if name not in chosen:
                continue
            cfg = TrainerConfig(
                model_path=tmp,
                backend=name.split("_")[0],
                max_tokens_per_micro_batch=args.micro_batch_tokens,
                optim=OptimConfig(lr=1e-5),
                loss=LossConfig(policy_loss="ppo"),
                compile=compiled,
            )
            trainers[name] = cls(cfg)
        if "hf" in chosen:
            trainers["hf"] = PlainHF(tmp, lr=1e-5)
        return measure(trainers, batch, args.steps)


def report(args, results: dict) -> dict:
    return {
        "benchmark": "train_throughput",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "model": {
            "family": "qwen2",
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads or max(1, args.heads // 2),
            "vocab": args.vocab,
            "dtype": "float32",
        },
        "workload": {
            "batch": args.batch,
            "prompt": args.prompt,
            "response": args.response,
            "samples_per_prompt": args.group_size,
            "max_tokens_per_micro_batch": args.micro_batch_tokens,
            "loss": "ppo, first update (old log-probs from its forward) + fwd/bwd + AdamW",
        },
        "load_avg": os.getloadavg(),
        **results,
        **{
            f"{ours}_over_{other}": (
                results[ours]["train_tokens_per_s"] / results[other]["train_tokens_per_s"]
            )
            for ours in ("megatron", "megatron_compiled")
            for other in ("deepspeed", "hf")
            if other in results and ours in results
        },
    }


if __name__ == "__main__":
    main()
