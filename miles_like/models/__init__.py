"""Models: the built-in tiny models, their tokenizers and the model store (cached directories)."""
