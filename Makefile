# The two commands of the README. Both create the environment in .venv/ first if it is missing
# (scripts/setup_env.sh is idempotent and re-runs only when pyproject.toml changed).
PY := .venv/bin/python

.PHONY: env train test bench

env:
	@bash scripts/setup_env.sh

# The default recipe: SFT warm start + GRPO on synthetic arithmetic, a tiny model, on CPU.
train: env
	$(PY) -m miles_like.train recipes/tiny_arith_grpo.yaml

# Lint and format checks first (seconds), then the suite.
test: env
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m pytest -q

# The CPU benchmarks, one JSON object each (minutes on 2 cores; see benchmarks/RESULTS.md).
bench: env
	$(PY) benchmarks/rollout_throughput.py
	$(PY) benchmarks/speculative.py
	$(PY) benchmarks/weight_sync.py
	$(PY) benchmarks/train_throughput.py
