"""Incremental detokenization of streamed text (`rollout.serving.streaming.TextDelta`).

Reference: the tokenizer's own decode of the whole sample (what the non-streamed response
returns). Token ids arrive in random chunks, mid-character bytes and special tokens included;
the concatenated deltas must equal the whole decode, with and without stop strings, for a
byte-level BPE (Qwen-like) and a Metaspace one (Llama-like: a leading space is part of a token
and is dropped at the start of a text).
"""

from __future__ import annotations

import random

import pytest

from rollout.serving.streaming import TextDelta
from rollout.stop_strings import cut_at_stop, decode

from tiny_hf import save_bpe_tokenizer

CORPUS = [
    "the cat sat on the mat, déjà vu: naïve café",
    "emoji 🙂 and 中文 and ümlauts ß",
    "one two three four five six seven eight nine ten",
] * 10


def metaspace_tokenizer(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(
        CORPUS,
        trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>", *bytes_]),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(str(directory))
    return fast


@pytest.fixture(scope="module", params=["byte_level", "metaspace"])
def tokenizer(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    if request.param == "byte_level":
        return save_bpe_tokenizer(directory, CORPUS, vocab_size=400)
    return metaspace_tokenizer(directory)


def streamed(tokenizer, ids: list[int], stops: list[str], rng: random.Random) -> str:
    text, at = TextDelta(tokenizer, stops), 0
    out = []
    while at < len(ids):
        step = rng.randint(1, 3)
        final = at + step >= len(ids)
        out.append(text.add(ids[at : at + step], final))
        at += step
    return "".join(out)


@pytest.mark.parametrize("seed", range(40))
def test_streamed_text_is_the_whole_decode(tokenizer, seed):
    rng = random.Random(seed)
    vocab = len(tokenizer)
    if seed % 2:  # real text, whose characters span several tokens
        ids = tokenizer.encode(rng.choice(CORPUS), add_special_tokens=False)
    else:  # any ids: lone bytes, invalid UTF-8, special tokens
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
    whole = decode(tokenizer, ids)
    assert streamed(tokenizer, ids, [], rng) == whole
    stops = [whole[len(whole) // 2 : len(whole) // 2 + 2]] if len(whole) > 4 else ["zz"]
    assert streamed(tokenizer, ids, stops, rng) == cut_at_stop(whole, stops)[0]


def test_an_incomplete_character_is_held_back(tokenizer):
    ids = tokenizer.encode("é 🙂", add_special_tokens=False)
    text = TextDelta(tokenizer, [])
    pieces = [text.add([i], False) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + text.add([], True) == decode(tokenizer, ids)


@pytest.mark.parametrize("seed", range(20))
def test_decode_is_the_tokenizers_own(tokenizer, seed):
    """`decode` may call the Rust backend directly (`plain_backend`); the reference is the
    transformers tokenizer's `decode` with special tokens skipped, on any ids."""
    from rollout.stop_strings import plain_backend

    assert plain_backend(tokenizer) is not None  # the fast path is the one under test
    rng = random.Random(seed)
    ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(0, 40))]
    assert decode(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_decode_keeps_a_tokenizers_clean_up_and_overrides(tokenizer):
    """With the clean-up pass on, or a class with its own decode, the tokenizer's decode runs."""
    from rollout.stop_strings import plain_backend

    ids = tokenizer.encode("one , two . three ' s", add_special_tokens=False)
    before, tokenizer.clean_up_tokenization_spaces = tokenizer.clean_up_tokenization_spaces, True
    try:
        assert plain_backend(tokenizer) is None
        assert decode(tokenizer, ids) == tokenizer.decode(ids, skip_special_tokens=True)
    finally:
        tokenizer.clean_up_tokenization_spaces = before

    class Shouting(type(tokenizer)):
        def decode(self, token_ids, **kwargs):
            return super().decode(token_ids, **kwargs).upper()

    loud = Shouting.__new__(Shouting)
    loud.__dict__.update(tokenizer.__dict__)
    assert plain_backend(loud) is None
    assert decode(loud, ids) == tokenizer.decode(ids, skip_special_tokens=True).upper()
