"""Synthetic tasks generated on the fly (no downloads): prompts, answers and their checkers."""
