"""Tokenizers: the built-in models' byte-level Hugging Face tokenizer, and `HFTokenizer`, the
one wrapper the loop uses for every model directory (built-in or real).

The built-in tokenizer is transformers' own `Qwen2Tokenizer` (the built-in models are Qwen2s)
over a vocabulary of the 256 byte-level symbols with no merges, so every byte of the text is
one token (an ASCII character is one byte), saved as `tokenizer.json` + `tokenizer_config.json`
with our ChatML tool template (`rollout.chat.CHATML_TOOLS_TEMPLATE`). It has to be Qwen2's class:
for a directory whose `config.json` says `model_type: qwen2`, `AutoTokenizer` builds Qwen2's
pipeline (its split regex, byte-level pre-tokenizer and decoder, NFC) from the vocabulary
whatever `tokenizer_config.json` names, so a tokenizer with any other pipeline would be loaded
as a different one (a character vocabulary without byte-level symbols loses every space and
newline). Built this way, the built-in directories load with `AutoTokenizer.from_pretrained(dir,
local_files_only=True)`, and with the `tokenizers` library from `tokenizer.json` alone, as the
same tokenizer. Ids: the special tokens first (`<|endoftext|>`=0, the pad token;
`<|im_start|>`; `<|im_end|>`, the EOS, so the engine stops at the end of a turn), then the tool
markup tags as added non-special tokens (one id each, kept when decoding with
`skip_special_tokens=True`, so a decoded turn still parses), then the 256 bytes in byte order.
"""

from __future__ import annotations

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

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)
MARKUP_TOKENS = (TOOL_CALL_OPEN, TOOL_CALL_CLOSE, TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE)
FIRST_BYTE_ID = len(SPECIAL_TOKENS) + len(MARKUP_TOKENS)  # the id of byte 0; byte b is this + b


def build_char_tokenizer():
    """The built-in models' tokenizer, as a transformers `Qwen2Tokenizer`."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    symbols = bytes_to_unicode()  # byte -> its byte-level symbol (the pre-tokenizer's alphabet)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + MARKUP_TOKENS)}
    vocab.update({symbols[b]: FIRST_BYTE_ID + b for b in range(256)})
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],  # no merges: each byte stays its own token
        unk_token=PAD,  # never produced: every byte is in the vocabulary
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        clean_up_tokenization_spaces=False,
    )
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKUP_TOKENS])
    tok.chat_template = CHATML_TOOLS_TEMPLATE
    return tok


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
