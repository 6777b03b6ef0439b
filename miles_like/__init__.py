"""The controller: recipe schema (`recipe.py`, `schema.py`), the configs it maps onto
(`build_configs.py`), the CLI (`cli.py`, `python -m miles_like.train`), rewards (`rewards.py`,
`reward_shaping.py`), advantage estimators (`advantages.py`), tokenizers (`tokenizer.py`: the
built-in models' character vocabulary and `HFTokenizer`), built-in tiny models
(`builtin_models.py`) and synthetic tasks (`tasks/`)."""
