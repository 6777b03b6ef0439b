"""The one error a config.json can cause."""

from __future__ import annotations


class UnsupportedModelError(ValueError):
    """A config.json we cannot run exactly; the one-line message names the config.json key."""
