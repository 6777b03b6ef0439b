"""benchmarks/vs_vllm.py without vLLM: its plan (`--dry-run`: the grid, the commands, vLLM's
set-up), its one-line argument errors, the environment check's verdict on a directory that is no
environment, and the generation worker on our engine (the protocol the benchmark reads, and the
exact token count the workload implies). Nothing here installs or imports vLLM."""

from __future__ import annotations

import json
import subprocess
import sys

from benchmark_runs import REPO, benchmark_process, run_benchmark

from benchmarks import vllm_env

from tiny_hf import make_hf_model, save_hf_model

SCRIPT = "vs_vllm.py"


def test_dry_run_plans_the_full_grid_and_vllms_fastest_setup():
    plan = run_benchmark(SCRIPT, "--dry-run")
    workloads, dtypes, prefix = ("32x128+128", "16x512+64"), ("float32", "bfloat16"), ("on", "off")
    assert sorted(plan["cells"]) == sorted(
        f"{w}:{d}:prefix_{p}" for w in workloads for d in dtypes for p in prefix
    )
    ours, vllm = plan["worker_commands"]["ours"], plan["worker_commands"]["vllm"]
    assert "--engine=ours" in ours and "--engine=vllm" in vllm
    assert vllm[vllm.index("--engine=vllm") - 2].endswith(".venv-vllm/bin/python")
    assert "--block-size=32" in vllm and "--compile" in vllm
    # the same CPUs for both, as many as threads (where the machine has them)
    assert ours[:3] == vllm[:3] or ours[0] != "taskset"
    env = plan["vllm_env"]
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # one process
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["OMP_NUM_THREADS"] == "2"
    preloaded = [p for p in plan["vllm_preloads"].values() if p]
    assert env.get("LD_PRELOAD", "") == ":".join(preloaded)
    bench = plan["bench_command"]
    assert bench[1:3] == ["bench", "serve"]
    for flag in ("--num-prompts=256", "--max-concurrency=64", "--random-input-len=128"):
        assert flag in bench
    assert plan["server_commands"]["ours"][1:3] == ["-m", "rollout.serving.server"]
    assert plan["server_commands"]["vllm"][1] == "serve"


def test_quick_dry_run_is_one_small_workload():
    plan = run_benchmark(SCRIPT, "--quick", "--dry-run", "--no-serving", "--dtypes=float32")
    assert plan["cells"] == ["4x32+16:float32:prefix_on", "4x32+16:float32:prefix_off"]
    assert plan["server_commands"] == {} and plan["bench_command"] == []


def test_bad_choice_is_one_line_naming_the_flag():
    proc = benchmark_process(SCRIPT, "--dry-run", "--dtypes=float16")
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert "--dtypes 'float16'" in last and "float32, bfloat16" in last


def test_env_check_names_what_is_missing(tmp_path):
    assert vllm_env.check(tmp_path) == [f"{tmp_path} has no bin/python"]


def test_generate_worker_on_our_engine_speaks_the_protocol(tmp_path):
    save_hf_model(make_hf_model("qwen2"), tmp_path)
    jobs = [
        {"prompts": [[5, 6, 7, 8], [9, 10, 11, 12, 13]], "n": 3, "new_tokens": 6},
        {"prompts": [[20, 21, 22]], "n": 2, "new_tokens": 4},
    ]
    stdin = "".join(json.dumps(j) + "\n" for j in jobs) + "\n"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks/vllm/generate_worker.py"), "--engine=ours"]
        + [f"--model={tmp_path}", "--threads=1", "--kv-tokens=512", "--no-prefix-cache"],
        input=stdin,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tagged = [line.split(" ", 1) for line in proc.stdout.splitlines() if line.startswith("@@")]
    assert [tag for tag, _ in tagged] == ["@@READY", "@@RESULT", "@@RESULT"]
    ready = json.loads(tagged[0][1])
    assert ready["engine"] == "miles_like rollout.Engine" and ready["torch_threads"] == 1
    for job, (_, payload) in zip(jobs, tagged[1:]):
        result = json.loads(payload)
        assert result["full"] and result["seconds"] > 0
        assert result["generated"] == len(job["prompts"]) * job["n"] * job["new_tokens"]


def test_server_cpu_counts_every_descendant_process_by_its_own_clock():
    """`process_tree_cpu_s` (the serving run's server CPU) against a grandchild's own
    `time.process_time()`: a shell whose child burns ~0.3 s of CPU, then sleeps alive."""
    from benchmarks.vs_vllm import process_tree_cpu_s, server_cpu

    burn = (
        "import time\n"
        "t = time.process_time()\n"
        "while time.process_time() - t < 0.3: pass\n"
        "print(time.process_time(), flush=True)\n"
        "time.sleep(30)\n"
    )
    shell = subprocess.Popen(
        ["sh", "-c", f'{sys.executable} -c "$0"', burn], stdout=subprocess.PIPE, text=True
    )
    import psutil

    try:
        own_clock = float(shell.stdout.readline())  # the child's CPU seconds, busy loop done
        counted = process_tree_cpu_s(shell.pid)
    finally:
        for proc in (*psutil.Process(shell.pid).children(recursive=True), shell):
            proc.kill()
        shell.wait()
    # the child's own clock, within the kernel's tick accounting (10 ms) and the shell's start
    assert own_clock >= 0.3
    assert own_clock - 0.03 <= counted <= own_clock + 0.15
    # per token and per second of the timed run, as the JSON reports them
    cpu = server_cpu({"server_cpu_s": 2.0, "duration": 4.0, "total_output_tokens": 1000})
    assert cpu == {
        "server_cpu_s": 2.0,
        "server_cores_busy": 0.5,
        "server_cpu_us_per_output_token": 2000.0,
    }
