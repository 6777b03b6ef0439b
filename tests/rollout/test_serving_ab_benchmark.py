"""benchmarks/serving_ab.py without vLLM: its plan (`--dry-run`: the base commit, the order of
the rounds, our server's and the load generator's commands) and its one-line error for a base
that is no commit. Nothing here installs or imports vLLM."""

from __future__ import annotations

import subprocess

from benchmark_runs import REPO, benchmark_process, run_benchmark

SCRIPT = "serving_ab.py"


def test_dry_run_alternates_the_trees_and_drives_our_server_as_vs_vllm_does():
    plan = run_benchmark(SCRIPT, "--dry-run", "--base", "HEAD", "--rounds", "3")
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()
    assert plan["base_commit"] == head
    assert plan["order"] == ["ab", "ba", "ab"]
    server, bench = plan["server_command"], plan["bench_command"]
    assert server[server.index("-m") + 1] == "rollout.serving.server"
    assert "--dtype=float32" in server
    assert bench[bench.index("bench") + 1] == "serve"
    for flag in ("--num-prompts=256", "--max-concurrency=64", "--random-output-len=128"):
        assert flag in bench
    assert server[:3] == bench[:3] or server[0] != "taskset"  # the same CPUs


def test_a_base_that_is_no_commit_is_one_line_naming_the_flag():
    proc = benchmark_process(SCRIPT, "--dry-run", "--base", "no-such-ref-anywhere")
    assert proc.returncode == 1
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("--base 'no-such-ref-anywhere': not a commit")
