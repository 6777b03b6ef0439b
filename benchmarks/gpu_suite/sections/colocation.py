"""A colocation cycle on one GPU without Ray: an engine process and a trainer process.

1. The engine generates (bf16, Triton, decode graphs, a 1 GiB KV pool).
2. It releases its memory (KV and weights); the trainer process's free device memory
   (`torch.cuda.mem_get_info`) must rise by at least 90% of the bytes the engine says it
   released: released memory that stays in the engine's caching allocator helps nobody.
3. The trainer (the HF model in float32, AdamW) trains one step on the engine's samples.
4. The engine resumes; the trainer pushes its weights over CUDA IPC (`weight_sync`).
5. The engine's parameters equal the trainer's export bitwise, and its seeded generations
   equal those of a fresh engine loaded from a checkpoint of the same weights, token for token
   and log-prob for log-prob.

The dry run runs the same cycle on CPU (shared memory instead of CUDA IPC), without step 2's
check: host memory returned by one process is not a figure of the other's.
"""

from __future__ import annotations

from benchmarks.gpu_suite import models
from benchmarks.gpu_suite.peers import Peer, link, unlink

RELEASED_SHARE = 0.9


def run(ctx) -> dict:
    tiny = ctx.dry_run
    model_dir = models.checkpoint(ctx.workdir, "tiny" if tiny else "hd128", std=0.05)
    engine_dtype = "float32" if tiny else "bfloat16"
    engine_kwargs = dict(
        device=ctx.device,
        dtype=engine_dtype,
        attention_backend="torch" if tiny else "triton",
        kv_cache_tokens=2048 if tiny else 131072,  # 1 GiB of bf16 K/V at this shape
        max_model_len=256,
        max_running_requests=64,
    )
    vocab = models.PRESETS["tiny" if tiny else "hd128"]["vocab_size"]
    prompts = models.random_prompts(vocab, 8, 8, 40, seed=1)
    sampled = dict(n=4, temperature=1.0, max_new_tokens=8 if tiny else 32, ignore_eos=True)
    ends = link()
    engine = Peer(
        "benchmarks.gpu_suite.workers:EngineWorker",
        model_dir,
        engine_kwargs,
        ends[0],
        name="engine",
    )
    trainer = Peer(
        "benchmarks.gpu_suite.workers:HFTrainerWorker",
        model_dir,
        ctx.device,
        engine_dtype,
        ends[1],
        name="trainer",
    )
    unlink(ends)
    try:
        engine.ready()
        trainer.ready()
        outs = engine.call("generate", prompts, {**sampled, "seed": 1})
        ctx.note(engine_memory=engine.call("memory"))

        trainer_free_before = trainer.call("memory")["free"]
        release = engine.call("release", True)
        trainer_free_after = trainer.call("memory")["free"]
        rise = trainer_free_after - trainer_free_before
        ctx.note(release=release, trainer_free_rise=rise)
        if ctx.cuda:
            ctx.check(
                "release_frees_device_memory",
                rise >= RELEASED_SHARE * release["released"],
                released_bytes=release["released"],
                other_process_free_rise=rise,
                engine_reserved_after=release["after"].get("reserved"),
                bound=f"rise >= {RELEASED_SHARE} x released",
            )

        sequences = [(p, s["token_ids"]) for p, per in zip(prompts, outs) for s in per]
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(sequences))]
        step = trainer.call("train_step", sequences, advantages)
        ctx.check("trainer_step_finite", step["finite"], **step)

        engine.call("resume")
        engine.submit("receive_weights")
        sync = trainer.call("send_weights")
        received = engine.result()
        ctx.note(sync=sync, received=received)
        new_dir = trainer.call("save", str(ctx.workdir / "colocation-trained"), model_dir)
        compared = engine.call("compare_params", new_dir)
        ctx.check(
            "synced_weights_bitwise_equal",
            not compared["differing"],
            differing=compared["differing"][:8],
            count=len(compared["differing"]),
            exported_in_another_dtype=compared["other_dtype"][:8],
        )

        params = {**sampled, "seed": 7}
        synced = engine.call("generate", prompts, params)
        fresh = engine.call("fresh_generate", new_dir, prompts, params)
        same_tokens = all(
            a["token_ids"] == b["token_ids"] for x, y in zip(synced, fresh) for a, b in zip(x, y)
        )
        same_logprobs = all(
            a["logprobs"] == b["logprobs"] for x, y in zip(synced, fresh) for a, b in zip(x, y)
        )
        ctx.check(
            "generations_equal_fresh_engine",
            same_tokens and same_logprobs,
            tokens_equal=same_tokens,
            logprobs_bitwise_equal=same_logprobs,
            samples=sum(len(x) for x in synced),
        )
    finally:
        engine.close()
        trainer.close()
    gb = sync["nbytes"] / 1e9
    return {
        "model": "tiny" if tiny else "hd128",
        "engine_dtype": engine_dtype,
        "released_gib": round(release["released"] / 2**30, 3),
        "trainer_free_rise_gib": round(rise / 2**30, 3),
        "sync_s": round(sync["total_s"], 4),
        "sync_gbps": round(gb / sync["total_s"], 2),
        "sync_buckets": sync["num_buckets"],
    }
