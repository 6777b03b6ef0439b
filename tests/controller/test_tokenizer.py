"""The character tokenizer: ids, round trips, chat template, save / load, and a tiny model built
for its vocabulary running in the engine."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_like.builtin_models import BUILTIN_MODELS, hf_config
from miles_like.tokenizer import CHARSET, SPECIAL_TOKENS, CharTokenizer

TOK = CharTokenizer()


def test_ids_and_vocab():
    assert (TOK.pad_token_id, TOK.eos_token_id, TOK.bos_token_id, TOK.unk_token_id) == (0, 1, 2, 3)
    assert TOK.vocab_size == len(SPECIAL_TOKENS) + len(CHARSET) == 103
    assert TOK.encode("0") == [len(SPECIAL_TOKENS) + CHARSET.index("0")]
    assert TOK.encode("é") == [TOK.unk_token_id]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=CHARSET + "".join(SPECIAL_TOKENS), max_size=60))
def test_round_trip(text):
    ids = TOK.encode(text)
    assert TOK.decode(ids, skip_special_tokens=False) == text
    assert all(0 <= i < TOK.vocab_size for i in ids)


def test_special_tokens_in_text_are_single_ids_and_skippable():
    ids = TOK.encode("12<eos><pad>")
    assert ids[-2:] == [TOK.eos_token_id, TOK.pad_token_id] and len(ids) == 4
    assert TOK.decode(ids) == "12"
    assert TOK.decode([TOK.bos_token_id] + TOK.encode("ab")) == "ab"
    with pytest.raises(ValueError, match="outside the vocabulary"):
        TOK.decode([TOK.vocab_size])


def test_chat_template_on_off():
    on = TOK.encode_prompt("1+2=", chat_template=True)
    off = TOK.encode_prompt("1+2=", chat_template=False)
    user, assistant = SPECIAL_TOKENS.index("<|user|>"), SPECIAL_TOKENS.index("<|assistant|>")
    assert on == [TOK.bos_token_id, user] + TOK.encode("1+2=") + [assistant]
    assert off == [TOK.bos_token_id] + TOK.encode("1+2=")


def test_save_load(tmp_path):
    TOK.save(tmp_path)
    again = CharTokenizer.load(tmp_path)
    assert again.vocab_size == TOK.vocab_size and again.encode("a<eos>9") == TOK.encode("a<eos>9")


def test_builtin_config_carries_the_tokenizer_fields():
    cfg = hf_config("tiny-qwen2", TOK)
    assert cfg["vocab_size"] == TOK.vocab_size and cfg["eos_token_id"] == TOK.eos_token_id
    assert cfg["pad_token_id"] == TOK.pad_token_id and cfg["bos_token_id"] == TOK.bos_token_id
    assert set(BUILTIN_MODELS) >= {"tiny-qwen2"}
    with pytest.raises(ValueError, match="model.builtin"):
        hf_config("nope", TOK)


def test_engine_runs_a_tiny_model_built_for_the_tokenizer(tmp_path):
    from rollout import Engine, EngineConfig, SamplingParams
    from rollout.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(tmp_path, hf_config("tiny-qwen2", TOK), seed=0)
    TOK.save(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["vocab_size"] == TOK.vocab_size
    engine = Engine(EngineConfig(model_path=str(tmp_path), kv_cache_tokens=256, page_size=4))
    assert engine.eos_token_ids == {TOK.eos_token_id}  # the engine stops at the tokenizer's EOS
    prompt = TOK.encode_prompt("12+34=", chat_template=True)
    out = engine.generate([prompt], SamplingParams(n=2, max_new_tokens=5, seed=0))[0]
    for sample in out:
        assert 1 <= len(sample.token_ids) <= 5
        assert all(0 <= t < TOK.vocab_size for t in sample.token_ids)
        # what rewards see: one character per non-special token, which encodes back to them
        plain = [t for t in sample.token_ids if t >= len(TOK.special_tokens)]
        text = TOK.decode(sample.token_ids)
        assert len(text) == len(plain) and TOK.encode(text) == plain
        assert sample.finish_reason in ("stop", "length")
        assert torch.isfinite(torch.as_tensor(sample.logprobs)).all()
