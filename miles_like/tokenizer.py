"""Tokenizers: the built-in models' character-level Hugging Face tokenizer, and `HFTokenizer`,
the one wrapper the loop uses for every model directory (built-in or real).

The built-in tokenizer is an HF `tokenizers` tokenizer (a BPE model with no merges over a
character vocabulary, so every character is one token) saved as `tokenizer.json` +
`tokenizer_config.json` with our ChatML tool template (`rollout.chat.CHATML_TOOLS_TEMPLATE`):
`AutoTokenizer.from_pretrained(dir, local_files_only=True)` loads built-in model directories
and their checkpoints like any real model's. Ids: the special tokens first (`<|endoftext|>`=0,
the pad token; `<|im_start|>`; `<|im_end|>`, the EOS, so the engine stops at the end of a
turn; `<unk>` for characters outside `CHARSET`), then the tool markup tags as added non-special
tokens (one id each, kept when decoding with `skip_special_tokens=True`, so a decoded turn still
parses), then one id per character of `CHARSET`.
"""

from __future__ import annotations

import string
from pathlib import Path

from rollout.chat import (
    CHATML_TOOLS_TEMPLATE,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    encode_text,
    render_ids,
)

PAD, IM_START, IM_END, UNK = "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, UNK)
MARKUP_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"


def build_char_tokenizer():
    """The built-in models' tokenizer, as a transformers `PreTrainedTokenizerFast`."""
    from tokenizers import AddedToken, Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + MARKUP_TOKENS + tuple(CHARSET))}
    # No pre-tokenizer and no merges: the text (between added tokens) is split into characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()  # characters are joined as they are, with no separator
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        unk_token=UNK,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHATML_TOOLS_TEMPLATE
    return fast


def save_char_tokenizer(directory: str | Path) -> None:
    """Write `tokenizer.json` + `tokenizer_config.json` to `directory`, the chat template inside
    the config (where every transformers version reads it; newer ones also read a separate
    `chat_template.jinja`)."""
    build_char_tokenizer().save_pretrained(str(directory), save_jinja_files=False)


class HFTokenizer:
    """A local Hugging Face tokenizer (transformers `AutoTokenizer`, no download) behind the calls
    the loop uses: `encode_prompt`, `encode_response`, `decode`, `eos_token_ids`, and
    `hf_config_fields` for a model built for it. `.tok` is the transformers tokenizer (for
    `rollout.chat` and agent code)."""

    def __init__(self, tok):
        self.tok = tok

    @classmethod
    def load(cls, directory: str | Path) -> HFTokenizer:
        # transformers is imported when a run starts, not on `import`
        from transformers import AutoTokenizer

        try:
            return cls(AutoTokenizer.from_pretrained(str(directory), local_files_only=True))
        except Exception as e:  # noqa: BLE001 (whatever AutoTokenizer raises, one clear line)
            raise ValueError(
                f"model.path={str(directory)!r}: cannot load its tokenizer "
                f"({type(e).__name__}: {e}); the directory needs the tokenizer "
                "files of the model"
            ) from None

    @property
    def eos_token_ids(self) -> list[int]:
        return [] if self.tok.eos_token_id is None else [int(self.tok.eos_token_id)]

    @property
    def vocab_size(self) -> int:
        return len(self.tok)  # added tokens included

    def encode_prompt(self, prompt: str, chat_template: bool) -> list[int]:
        if chat_template:
            if self.tok.chat_template is None:
                raise ValueError(
                    "data.chat_template=true but the tokenizer has no chat "
                    "template; set data.chat_template: false"
                )
            return render_ids(self.tok, [{"role": "user", "content": prompt}])
        return self.tok.encode(prompt, add_special_tokens=True)

    def encode_response(self, text: str) -> list[int]:
        """A target completion as the model should produce it: the text, then the EOS (the
        end-of-turn token, for chat templates)."""
        return encode_text(self.tok, text) + self.eos_token_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def hf_config_fields(self) -> dict[str, int | None]:
        """The `config.json` entries a model built for this tokenizer needs."""
        return {
            "vocab_size": self.vocab_size,
            "bos_token_id": self.tok.bos_token_id,
            "eos_token_id": self.tok.eos_token_id,
            "pad_token_id": self.tok.pad_token_id,
        }


def builtin_tokenizer() -> HFTokenizer:
    return HFTokenizer(build_char_tokenizer())


def load_tokenizer(directory: str | Path) -> HFTokenizer:
    """The model directory's Hugging Face tokenizer (built-in models have one too)."""
    return HFTokenizer.load(directory)


assert set(string.digits + "+-*=") <= set(CHARSET)  # the arithmetic task's alphabet
