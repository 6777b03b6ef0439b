# The two commands of the README. Both create the environment in .venv/ first if it is missing
# (scripts/setup_env.sh is idempotent and re-runs only when pyproject.toml changed).
PY := .venv/bin/python

.PHONY: env train test bench

env:
	@bash scripts/setup_env.sh

# The default recipe: SFT warm start + GRPO on synthetic arithmetic, a tiny model, on CPU.
train: env
	$(PY) -m miles_like.train recipes/tiny_arith_grpo.yaml

# Lint and format checks first (seconds), then the suite in two worker processes, one test
# file each at a time (a module's fixtures, such as its local Ray, stay in one process). The
# end-to-end tests leave a core idle much of the time (one phase computes while the other
# waits, processes start), so two files at once keep both cores busy; one OpenMP thread per
# process, since two 2-thread processes on 2 cores spin-wait against each other.
test: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The CPU benchmarks, one JSON object each (minutes on 2 cores; see benchmarks/RESULTS.md).
bench: env
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/speculative.py
	$(PY) benchmarks/weight_sync.py
	$(PY) benchmarks/train_throughput.py
