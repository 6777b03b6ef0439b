"""Entry point: `python -m miles_like.train RECIPE.yaml [key=value ...] [--dry-run]`.

See `cli.py` for the command line, `recipe.py` for the recipe and `loop.py` for the RL loop.
"""

from __future__ import annotations

import sys

from miles_like.cli import main

if __name__ == "__main__":
    sys.exit(main())
