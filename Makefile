# The two commands of the README. Both create the environment in .venv/ first if it is missing
# (scripts/setup_env.sh is idempotent and re-runs only when pyproject.toml changed).
PY := .venv/bin/python

.PHONY: env train test bench

env:
	@bash scripts/setup_env.sh

# Until the controller lands (issue: miles_like/ controller), `train` runs the engine's
# generation demo; it will run `python -m miles_like.train recipes/tiny_arith_grpo.yaml`.
train: env
	$(PY) -m rollout.demo

test: env
	$(PY) -m pytest -q

bench: env
	$(PY) benchmarks/rollout_throughput.py
