"""Stop strings, token-exact: a sample stops at the token that completes a stop string, and
that token stays in its token ids (they are exactly what was sampled); only the returned text is
cut before the stop string.

The check runs in the engine after each sampled token (`Engine.add_request(stop_check=...)`) on
the decoded tail of the sample: a stop string of c characters spans at most 4c bytes, so at most
4c tokens of a byte-level vocabulary, plus one whose first bytes may belong to an earlier char.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rollout.sequence import StopCheck


def decode(tokenizer, token_ids: Sequence[int]) -> str:
    """The text of generated tokens as returned to clients (special tokens skipped): the
    tokenizer's `decode`, or the same call on its Rust backend where that is all it does."""
    backend = plain_backend(tokenizer)
    if backend is not None:
        return backend.decode(list(token_ids), skip_special_tokens=True)
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


def plain_backend(tokenizer):
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose `decode` returns
    exactly that backend's decode: its class keeps the base `decode` and `_decode` (they add
    only argument conversion around the backend call) and the clean-up pass is off. Called
    for every streamed token, twice (`TextDelta`): the wrapper costs several times the decode
    of a few tokens. None for anything else (their own `decode` is used)."""
    base = sys.modules.get("transformers.tokenization_utils_tokenizers")
    if base is None or tokenizer is None:  # not a transformers tokenizer
        return None
    backend_class = base.TokenizersBackend
    cls = type(tokenizer)
    if (
        not isinstance(tokenizer, backend_class)
        or cls.decode is not backend_class.decode
        or cls._decode is not backend_class._decode
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return None
    return tokenizer.backend_tokenizer


def make_stop_check(tokenizer, stops: Sequence[str]) -> StopCheck | None:
    """A check that is True once the sample's text contains one of `stops`; None without stops."""
    stops = [s for s in stops if s]
    if not stops:
        return None
    window = 4 * max(len(s) for s in stops) + 1

    def check(generated: list[int]) -> bool:
        tail = decode(tokenizer, generated[-window:])
        return any(s in tail for s in stops)

    return check


def cut_at_stop(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """`text` cut before the earliest stop string, and whether one was found."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return (text[: min(found)], True) if found else (text, False)
