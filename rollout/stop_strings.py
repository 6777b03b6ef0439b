"""Stop strings, token-exact: a sample stops at the token that completes a stop string, and
that token stays in its token ids (they are exactly what was sampled); only the returned text is
cut before the stop string.

The check runs in the engine after each sampled token (`Engine.add_request(stop_check=...)`) on
the decoded tail of the sample: a stop string of c characters spans at most 4c bytes, so at most
4c tokens of a byte-level vocabulary, plus one whose first bytes may belong to an earlier char.
"""

from __future__ import annotations

from collections.abc import Sequence

from rollout.sequence import StopCheck


def decode(tokenizer, token_ids: Sequence[int]) -> str:
    """The text of generated tokens as returned to clients (special tokens skipped)."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True)


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
