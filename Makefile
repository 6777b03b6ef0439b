# The two commands of the README. Both create the environment in .venv/ first if it is missing
# (scripts/setup_env.sh is idempotent and re-runs only when pyproject.toml changed).
PY := .venv/bin/python

.PHONY: env train test bench

env:
	@bash scripts/setup_env.sh

# The default recipe: SFT warm start + GRPO on synthetic arithmetic, a tiny model, on CPU.
train: env
	$(PY) -m miles_like.train recipes/tiny_arith_grpo.yaml

test: env
	$(PY) -m pytest -q

bench: env
	$(PY) benchmarks/rollout_throughput.py
