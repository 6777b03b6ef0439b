"""GPU suite: one prepared run that checks and times everything GPU-specific on one H100 / H200
with Python 3.12, its own torch, no package registry and no Ray, in at most 5 minutes.

    benchmarks/gpu_suite/download_wheels.sh   # here: wheels the device lacks -> .gpu_wheels/
    benchmarks/gpu_suite.sh                   # there (carry .gpu_wheels); JSON lines to stdout
                                              # and to $OUT/gpu_suite.jsonl, logs to gpu_suite.log
    benchmarks/gpu_suite.sh --dry-run         # on CPU: tiny sizes, Triton interpreted

With the device tool: `run(command="benchmarks/gpu_suite.sh", carry=[".gpu_wheels"],
timeout_s=330)`; the JSON lines come back in $OUT/gpu_suite.jsonl, the sections' output in
$OUT/gpu_suite.log.

The harness (`harness.py`, standard library only) prints the plan with each section's budget,
installs the carried wheels, preflights every import a section needs (a missing one skips that
section with the reason), then runs each section (`sections/`) in its own process group with its
own timeout: a crash, a hang or a sticky CUDA error costs that section only. The sections call
the engine, trainer and weight-sync libraries directly, in plain processes (two spawned ones
where a trainer and an engine share the GPU: `peers.py`). `ok` is false when any exactness check
fails, a section errors, crashes or times out, or one is skipped that this machine should run.
"""
