"""The suite's sections, in the order they run (most value per device minute first), with
their budgets on one H100 / H200. Declarations only: the harness reads this without importing
torch; each section's module is imported in its own process.

The budgets are timeouts, not measurements, and add up (with the preflight's) to the suite's
cap, so the whole run ends within 5 minutes even when every section runs to its budget.
"""

from __future__ import annotations

from benchmarks.gpu_suite.harness import Section

ROLLOUT = ("torch", "rollout")
TRITON = ("triton", "rollout.kernels")

SECTIONS: tuple[Section, ...] = (
    Section(
        "kernels",
        "benchmarks.gpu_suite.sections.kernels:run",
        "Triton KV store and decode attention vs the torch reference (fp32, fp16, bf16; head_dim"
        " 64 and 128; GQA 7:1 and 1:1; the decode graphs' full-width page table); decode "
        "attention GB/s against the HBM peak",
        budget_s=40,
        requires=(*ROLLOUT, *TRITON),
        cpu=True,
    ),
    Section(
        "decode_graphs",
        "benchmarks.gpu_suite.sections.decode_graphs:run",
        "decode graphs vs the dynamic path: capture, in-place update_weights, replay of the same "
        "graphs; release -> resume (re-capture timed)",
        budget_s=25,
        requires=(*ROLLOUT, *TRITON),
        cpu=True,
    ),
    Section(
        "colocation",
        "benchmarks.gpu_suite.sections.colocation:run",
        "two processes on one GPU: generate, release (the trainer process sees >= 90% of it "
        "freed), train a step, CUDA IPC sync, generations equal a fresh engine's",
        budget_s=40,
        requires=(*ROLLOUT, *TRITON, "weight_sync", "transformers"),
        cpu=True,
    ),
    Section(
        "engine_vs_hf",
        "benchmarks.gpu_suite.sections.engine_vs_hf:run",
        "bf16 engine log-probs (Triton, graphs) vs HF transformers bf16, both against HF float32 "
        "on the same bf16 weights",
        budget_s=22,
        requires=(*ROLLOUT, *TRITON, "transformers"),
        cpu=True,
    ),
    Section(
        "megatron",
        "benchmarks.gpu_suite.sections.megatron:run",
        "megatron-core bf16 train step on one GPU, HF export, CUDA IPC into an engine in another "
        "process, engine-vs-trainer mismatch KL before and after the sync",
        budget_s=40,
        requires=(*ROLLOUT, *TRITON, "weight_sync", "megatron.core", "trainer.megatron_trainer"),
        cpu=True,
    ),
    Section(
        "speculation",
        "benchmarks.gpu_suite.sections.speculation:run",
        "greedy output with group / draft speculation equals no speculation; tokens/s and"
        " accepted length at batch 8",
        budget_s=23,
        requires=(*ROLLOUT, *TRITON),
        cpu=True,
    ),
    Section(
        "throughput",
        "benchmarks.gpu_suite.sections.throughput:run",
        "engine vs HF generate tokens/s on a Qwen2.5-0.5B-shaped bf16 model (GRPO workload)",
        budget_s=20,
        requires=(*ROLLOUT, *TRITON, "transformers"),
        cpu=True,
    ),
    Section(
        "fp8",
        "benchmarks.gpu_suite.sections.fp8:run",
        "FP8 rollout weights: the FP8 engine equals float32 on the dequantized weights (greedy "
        "tokens, log-probs within 1e-4), its weights the checkpoint's quantized bitwise; push "
        "bytes / time and decode tokens/s vs bf16",
        budget_s=15,
        requires=(*ROLLOUT, *TRITON, "weight_sync", "quantization"),
        cpu=True,
    ),
    Section(
        "prefill_decode",
        "benchmarks.gpu_suite.sections.prefill_decode:run",
        "prefill-decode disaggregation between two processes over CUDA IPC: the decode process "
        "samples what one engine samples (cold, prefix hits), the K/V arrive bitwise; handoff "
        "bytes and copy GB/s against the prefill",
        budget_s=15,
        requires=(*ROLLOUT, *TRITON, "weight_sync", "miles_like.run.handoff_transport"),
        cpu=True,
    ),
    Section(
        "compiled_decode",
        "benchmarks.gpu_suite.sections.compiled_decode:run",
        "EngineConfig.compile (inductor inside the decode graphs) vs eager: greedy tokens equal, "
        "log-probs within 1e-4; compile seconds",
        budget_s=20,
        requires=(*ROLLOUT, *TRITON, "rollout.compiled"),
    ),
)

NOT_COVERED = (
    "A1-A3 collectives on NCCL-only groups: need 2+ GPUs (CPU guards in tests/)",
    "A4 CUDA IPC routing by GPU UUID: needs 2+ GPUs",
    "engine tensor parallelism and the NCCL broadcast weight sync: need 2 GPUs",
    "DeepSpeed: not carried",
    "Ray placement and the controller's phase order: Ray is not carried (its wheel alone is over"
    " the carry limit); the sections call the libraries in plain processes",
)
