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
# file each at a time (a module's fixtures, such as its local Ray, stay in one process), the
# end-to-end files first (tests/conftest.py). One OpenMP thread per process, and per worker of
# the runs the tests start (the default cluster.cpu_threads is capped by OMP_NUM_THREADS): two
# runs of 2-thread workers side by side on 2 cores spin-wait against each other.
# Times: benchmarks/RESULTS.md.
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
