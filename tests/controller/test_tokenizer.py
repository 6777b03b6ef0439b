"""The built-in models' tokenizer: a byte-level HF tokenizer that transformers' `AutoTokenizer`
loads from a model directory as the same tokenizer (also where `config.json` says qwen2), with
our ChatML tool template; ids, round trips, the model store's cache key, and a tiny model built
for its vocabulary running in the engine."""

from __future__ import annotations

import json
import unicodedata

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from miles_like.models.builtin import BUILTIN_MODELS, hf_config
from miles_like.models.tokenizer import (
    FIRST_BYTE_ID,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    HFTokenizer,
    builtin_tokenizer,
    load_tokenizer,
    save_char_tokenizer,
)

TOK = builtin_tokenizer()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The built-in tokenizer as transformers loads it back from a saved directory."""
    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("char_tok")
    save_char_tokenizer(directory)
    return directory, AutoTokenizer.from_pretrained(str(directory), local_files_only=True)


def test_saved_directory_loads_with_auto_tokenizer(saved):
    directory, tok = saved
    assert sorted(p.name for p in directory.iterdir()) == [
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    config = json.loads((directory / "tokenizer_config.json").read_text())
    assert config["chat_template"] == TOK.tok.chat_template and config["eos_token"] == "<|im_end|>"
    assert tok.chat_template == TOK.tok.chat_template
    assert (tok.pad_token, tok.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert len(tok) == len(SPECIAL_TOKENS) + len(MARKUP_TOKENS) + 256 == 263
    assert load_tokenizer(directory).hf_config_fields() == TOK.hf_config_fields()


def test_ids_are_one_per_byte(saved):
    _, tok = saved
    ascii_text = "".join(chr(c) for c in range(32, 127)) + "\n\t"
    want = [FIRST_BYTE_ID + b for b in ascii_text.encode()]
    assert tok.encode(ascii_text, add_special_tokens=False) == want
    assert tok.convert_tokens_to_ids(list(SPECIAL_TOKENS + MARKUP_TOKENS)) == list(
        range(FIRST_BYTE_ID)
    )
    assert tok.encode("é", add_special_tokens=False) == [FIRST_BYTE_ID + b for b in "é".encode()]
    assert tok.encode("12", add_special_tokens=True) == tok.encode("12", add_special_tokens=False)


PIECES = st.one_of(st.text(max_size=8), st.sampled_from(SPECIAL_TOKENS + MARKUP_TOKENS))


@settings(max_examples=200, deadline=None)
@given(st.lists(PIECES, max_size=12).map("".join))
@example("\uf900 e\u0301<|im_end|>\u0301")
def test_round_trip_of_any_text(saved, text):
    """Any text comes back as its NFC form: the tokenizer normalizes as Qwen2's does (so a
    compatibility ideograph such as U+F900 comes back as U+8C48); NFC text comes back as is."""
    _, tok = saved
    ids = tok.encode(text, add_special_tokens=False)
    nfc = unicodedata.normalize("NFC", text)
    assert tok.decode(ids, skip_special_tokens=False) == nfc
    assert all(0 <= i < len(tok) for i in ids)
    # markup tags are not special: skipping specials drops only the ChatML markers
    stripped = nfc
    for t in SPECIAL_TOKENS:
        stripped = stripped.replace(t, "")
    assert tok.decode(ids, skip_special_tokens=True) == stripped


AGREE_TEXT = '<|im_start|>user\n12 + 34 =<|im_end|>\n<tool_call>\n{"a": 1}\n</tool_call>\t~  é'


def test_saved_and_built_tokenizers_agree(saved):
    _, tok = saved
    want = TOK.tok.encode(AGREE_TEXT, add_special_tokens=False)
    assert tok.encode(AGREE_TEXT, add_special_tokens=False) == want
    tags = ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>")  # one id each
    assert len(want) == len(AGREE_TEXT.encode()) - len("".join(tags).encode()) + len(tags)


def test_a_model_directory_loads_the_same_tokenizer(tmp_path, monkeypatch):
    """With the built-in model's `config.json` (model_type qwen2) beside it, `AutoTokenizer`
    picks its class by the model type, and `tokenizers` reads `tokenizer.json` alone: both
    must still be the built tokenizer (a space or newline lost there was a real bug)."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    from miles_like.models import store as model_store
    from miles_like.recipe.sections import ModelSection

    monkeypatch.setenv("MILES_LIKE_CACHE", str(tmp_path))
    directory = model_store.base_model_dir(ModelSection(builtin="tiny-qwen2"), seed=0)
    assert json.loads((directory / "config.json").read_text())["model_type"] == "qwen2"
    want = TOK.tok.encode(AGREE_TEXT, add_special_tokens=False)
    auto = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    assert auto.encode(AGREE_TEXT, add_special_tokens=False) == want
    assert auto.decode(want, skip_special_tokens=False) == AGREE_TEXT
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    assert raw.encode(AGREE_TEXT, add_special_tokens=False).ids == want
    assert load_tokenizer(directory).tok.encode(AGREE_TEXT, add_special_tokens=False) == want


def test_prompt_and_response_go_through_the_chat_template():
    ids = TOK.encode_prompt("1+2=", chat_template=True)
    assert (
        TOK.decode(ids, skip_special_tokens=False)
        == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n"
    )
    assert TOK.encode_prompt("1+2=", chat_template=False) == TOK.tok.encode(
        "1+2=", add_special_tokens=False
    )
    assert TOK.encode_response("3")[-1] == TOK.tok.convert_tokens_to_ids("<|im_end|>")
    assert TOK.eos_token_ids == [TOK.tok.convert_tokens_to_ids("<|im_end|>")]


def test_missing_tokenizer_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="model.path=.*cannot load its tokenizer"):
        HFTokenizer.load(tmp_path)


def test_builtin_config_carries_the_tokenizer_fields():
    cfg = hf_config("tiny-qwen2", TOK)
    assert cfg["vocab_size"] == 263 and cfg["eos_token_id"] == TOK.eos_token_ids[0]
    assert cfg["pad_token_id"] == TOK.tok.pad_token_id == 0
    assert set(BUILTIN_MODELS) >= {"tiny-qwen2"}
    with pytest.raises(ValueError, match="model.builtin"):
        hf_config("nope", TOK)


def test_model_store_key_follows_the_tokenizer(tmp_path, monkeypatch):
    """The built-in model's cache key hashes the tokenizer's serialization: a model built for
    another vocabulary or template is never reused."""
    from miles_like.models import store as model_store
    from miles_like.recipe.sections import ModelSection

    monkeypatch.setenv("MILES_LIKE_CACHE", str(tmp_path))
    first = model_store.base_model_dir(ModelSection(builtin="tiny-qwen2"), seed=0)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in first.iterdir()
    }
    assert model_store.base_model_dir(ModelSection(builtin="tiny-qwen2"), seed=0) == first

    def other_template():
        tok = builtin_tokenizer()
        tok.tok.chat_template = tok.tok.chat_template.replace("# Tools", "# Functions")
        return tok

    monkeypatch.setattr(model_store, "builtin_tokenizer", other_template)
    assert model_store.base_model_dir(ModelSection(builtin="tiny-qwen2"), seed=0) != first


def test_engine_runs_a_tiny_model_built_for_the_tokenizer(tmp_path):
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(tmp_path, hf_config("tiny-qwen2", TOK), seed=0)
    save_char_tokenizer(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == TOK.vocab_size
    engine = Engine(EngineConfig(model_path=str(tmp_path), kv_cache_tokens=256, page_size=4))
    # the engine stops at the end-of-turn token
    assert engine.eos_token_ids == {TOK.tok.convert_tokens_to_ids("<|im_end|>")}
    prompt = load_tokenizer(tmp_path).encode_prompt("12+34=", chat_template=True)
    out = engine.generate([prompt], SamplingParams(n=2, max_new_tokens=5, seed=0))[0]
    for sample in out:
        assert 1 <= len(sample.token_ids) <= 5
        assert all(0 <= t < TOK.vocab_size for t in sample.token_ids)
        # what rewards see (specials skipped) is the sampled bytes as UTF-8 (a random model
        # samples invalid sequences too: Python's decoder replaces them as the tokenizer does)
        markup = {TOK.tok.convert_tokens_to_ids(t): t.encode() for t in MARKUP_TOKENS}
        special = set(TOK.tok.all_special_ids)
        sampled = b"".join(
            markup.get(t, bytes([t - FIRST_BYTE_ID]) if t >= FIRST_BYTE_ID else b"")
            for t in sample.token_ids
            if t not in special
        )
        assert TOK.decode(sample.token_ids) == sampled.decode("utf-8", errors="replace")
        assert sample.finish_reason in ("stop", "length")
        assert torch.isfinite(torch.as_tensor(sample.logprobs)).all()
