"""Entry point: `python -m miles_like.train RECIPE.yaml [key=value ...] [--dry-run]`.

See `cli.py` for the command line, `recipe.py` for the recipe and `loop.py` for the RL loop.

Nothing is imported at the top: the run's reward and tool worker processes are spawned, and a
spawned process imports its parent's `__main__` module again (this one) before it runs; the
CLI's imports (torch among them) would cost every worker seconds of CPU and memory it never
uses.
"""

if __name__ == "__main__":
    import sys

    from miles_like.recipe.cli import main

    sys.exit(main())
