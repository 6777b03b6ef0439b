"""megatron-core on one GPU feeding an engine in another process, as one colocated RL step does.

1. The engine (bf16, Triton, decode graphs) samples 8 prompts x 4 at T = 1, then releases.
2. The megatron trainer (bf16 compute, fp32 AdamW masters, world of 1) takes one PPO step on
   them with the engine's log-probs: `train/mismatch_kl` before the update compares engine and
   trainer on the same weights.
3. The engine resumes; the trainer pushes `export_hf_weights()` over CUDA IPC into the engine,
   then offloads.
4. The engine's parameters equal the trainer's export bitwise; the engine samples again; the
   trainer onloads and scores those samples: the mismatch after the sync (same weights again).

Bound: mismatch KL (k3 estimate of KL(engine || trainer), trainer.mismatch) at most 1e-3 on
both steps (about 4e-5 on CPU). A sync that lost or misplaced a tensor, or a transposed or
mis-split projection, gives a KL of order 1 on this model; bf16 rounding alone stays far below
the bound.
"""

from __future__ import annotations

from benchmarks.gpu_suite import models
from benchmarks.gpu_suite.peers import Peer, link, unlink

MISMATCH_KL_BOUND = 1e-3
LR = 1e-5


def flatten(prompts, outs):
    tokens, prompt_lens, logprobs = [], [], []
    for prompt, per in zip(prompts, outs):
        for s in per:
            tokens.append(prompt + s["token_ids"])
            prompt_lens.append(len(prompt))
            logprobs.append(s["logprobs"])
    return tokens, prompt_lens, logprobs


def run(ctx) -> dict:
    tiny = ctx.dry_run
    preset = "tiny" if tiny else "hd128"
    model_dir = models.checkpoint(ctx.workdir, preset, std=0.05)
    engine_kwargs = dict(
        device=ctx.device,
        dtype="bfloat16",
        attention_backend="torch" if tiny else "triton",
        kv_cache_tokens=2048 if tiny else 32768,
        max_model_len=256,
        max_running_requests=64,
    )
    prompts = models.random_prompts(models.PRESETS[preset]["vocab_size"], 8, 8, 40, seed=2)
    params = dict(n=4, temperature=1.0, max_new_tokens=8 if tiny else 32, ignore_eos=True)
    ends = link()
    engine = Peer(
        "benchmarks.gpu_suite.workers:EngineWorker",
        model_dir,
        engine_kwargs,
        ends[0],
        name="engine",
    )
    trainer = Peer(
        "benchmarks.gpu_suite.workers:MegatronTrainerWorker",
        model_dir,
        "bfloat16",
        LR,
        ends[1],
        name="megatron trainer",
    )
    unlink(ends)
    try:
        engine.ready()
        trainer.ready()
        tokens, prompt_lens, logprobs = flatten(
            prompts, engine.call("generate", prompts, {**params, "seed": 1})
        )
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(tokens))]
        engine.call("release", True)  # the loop's order: the engine gives the device up first
        step = trainer.call("train_step", tokens, prompt_lens, advantages, logprobs)
        ctx.note(train_step=step)
        ctx.check(
            "mismatch_before_update",
            step.get("mismatch_kl", float("inf")) <= MISMATCH_KL_BOUND,
            mismatch_kl=step.get("mismatch_kl"),
            logprob_diff_max=step.get("logprob_diff_max"),
            logprob_diff_mean=step.get("logprob_diff_mean"),
            bound=MISMATCH_KL_BOUND,
        )

        engine.call("resume")
        engine.submit("receive_weights")
        sync = trainer.call("send_weights")
        ctx.note(sync=sync, received=engine.result())
        new_dir = trainer.call("save", str(ctx.workdir / "megatron-trained"), model_dir)
        offloaded = trainer.call("offload")
        compared = engine.call("compare_params", new_dir)
        ctx.check(
            "synced_weights_bitwise_equal",
            not compared["differing"],
            differing=compared["differing"][:8],
            count=len(compared["differing"]),
            exported_in_another_dtype=compared["other_dtype"][:8],
        )

        tokens2, prompt_lens2, logprobs2 = flatten(
            prompts, engine.call("generate", prompts, {**params, "seed": 2})
        )
        onloaded = trainer.call("onload")
        after = trainer.call("mismatch", tokens2, prompt_lens2, logprobs2)
        ctx.check(
            "mismatch_after_sync",
            after.get("mismatch_kl", float("inf")) <= MISMATCH_KL_BOUND,
            bound=MISMATCH_KL_BOUND,
            **after,
        )
    finally:
        engine.close()
        trainer.close()
    return {
        "model": preset,
        "sync_s": round(sync["total_s"], 4),
        "sync_bytes": sync["nbytes"],
        "offloaded_bytes": offloaded,
        "onloaded_bytes": onloaded,
        "grad_norm": step.get("grad_norm"),
    }
