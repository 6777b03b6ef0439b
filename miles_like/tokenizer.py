"""A local character-level tokenizer for the built-in tiny models (nothing to download).

Ids: the special tokens first (`<pad>`=0, `<eos>`=1, `<bos>`=2, `<unk>`=3, then the chat markers),
then one id per character of `CHARSET` (printable ASCII, newline, tab). Any other character
encodes to `<unk>`. Special-token strings inside a text encode to their single id, as in HF
tokenizers, so `decode(encode(s), skip_special_tokens=False) == s` for every string over
`CHARSET`.

The chat template (on/off per recipe) wraps a prompt as `<|user|>PROMPT<|assistant|>`; the model
answers after `<|assistant|>` and ends with `<eos>`.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ("<pad>", "<eos>", "<bos>", "<unk>", "<|user|>", "<|assistant|>")
CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"
TOKENIZER_FILE = "char_tokenizer.json"


class CharTokenizer:
    def __init__(self, charset: str = CHARSET, special_tokens: tuple[str, ...] = SPECIAL_TOKENS):
        if len(set(charset)) != len(charset):
            raise ValueError("CharTokenizer charset has repeated characters")
        missing = set(SPECIAL_TOKENS[:6]) - set(special_tokens)
        if missing:
            raise ValueError(f"CharTokenizer special_tokens lack {sorted(missing)}")
        self.charset = charset
        self.special_tokens = tuple(special_tokens)
        self._special_ids = {tok: i for i, tok in enumerate(self.special_tokens)}
        self._char_ids = {ch: len(self.special_tokens) + i for i, ch in enumerate(charset)}
        self._id_to_text = list(self.special_tokens) + list(charset)
        # Longest first, so that no special token shadows a longer one sharing its prefix.
        self._special_re = re.compile("|".join(
            re.escape(t) for t in sorted(self.special_tokens, key=len, reverse=True)))

    pad_token_id = property(lambda self: self._special_ids["<pad>"])
    eos_token_id = property(lambda self: self._special_ids["<eos>"])
    bos_token_id = property(lambda self: self._special_ids["<bos>"])
    unk_token_id = property(lambda self: self._special_ids["<unk>"])

    @property
    def eos_token_ids(self) -> list[int]:
        return [self.eos_token_id]

    @property
    def vocab_size(self) -> int:
        return len(self._id_to_text)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = [self.bos_token_id] if add_bos else []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(self._char_ids.get(ch, self.unk_token_id) for ch in text[pos:m.start()])
            ids.append(self._special_ids[m.group()])
            pos = m.end()
        ids.extend(self._char_ids.get(ch, self.unk_token_id) for ch in text[pos:])
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = []
        n_special = len(self.special_tokens)
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
            if skip_special_tokens and i < n_special:
                continue
            out.append(self._id_to_text[i])
        return "".join(out)

    def render_prompt(self, prompt: str, chat_template: bool) -> str:
        """The prompt text the model sees: wrapped in the chat markers, or as is."""
        return f"<|user|>{prompt}<|assistant|>" if chat_template else prompt

    def encode_prompt(self, prompt: str, chat_template: bool) -> list[int]:
        return self.encode(self.render_prompt(prompt, chat_template), add_bos=True)

    def encode_response(self, text: str) -> list[int]:
        """A target completion as the model should produce it: the text, then `<eos>`."""
        return self.encode(text) + [self.eos_token_id]

    def hf_config_fields(self) -> dict[str, Any]:
        """The `config.json` entries a model built for this tokenizer needs."""
        return {"vocab_size": self.vocab_size, "bos_token_id": self.bos_token_id,
                "eos_token_id": self.eos_token_id, "pad_token_id": self.pad_token_id}

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"type": "char", "charset": self.charset,
                                    "special_tokens": list(self.special_tokens)}, indent=2))
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "CharTokenizer":
        data = json.loads((Path(directory) / TOKENIZER_FILE).read_text())
        if data.get("type") != "char":
            raise ValueError(f"{directory}/{TOKENIZER_FILE}: not a character tokenizer file")
        return cls(data["charset"], tuple(data["special_tokens"]))


class HFTokenizer:
    """A local Hugging Face tokenizer (transformers `AutoTokenizer`, no download) behind the same
    three calls the loop uses: `encode_prompt`, `decode`, `eos_token_ids`."""

    def __init__(self, directory: str | Path):
        from transformers import AutoTokenizer  # only real-model runs need transformers

        try:
            self.tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:
            raise ValueError(f"model.path={str(directory)!r}: cannot load its tokenizer "
                             f"({type(e).__name__}: {e}); the directory needs the tokenizer "
                             "files of the model") from None

    @property
    def eos_token_ids(self) -> list[int]:
        return [] if self.tok.eos_token_id is None else [int(self.tok.eos_token_id)]

    def encode_prompt(self, prompt: str, chat_template: bool) -> list[int]:
        if chat_template:
            if self.tok.chat_template is None:
                raise ValueError("data.chat_template=true but the tokenizer has no chat "
                                 "template; set data.chat_template: false")
            # Rendered to text, then encoded without adding specials (the template has them):
            # the return type of tokenize=True differs across transformers versions.
            text = self.tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=False)
            return self.tok.encode(text, add_special_tokens=False)
        return self.tok.encode(prompt, add_special_tokens=True)

    def encode_response(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False) + self.eos_token_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def load_tokenizer(directory: str | Path) -> CharTokenizer | HFTokenizer:
    """The character tokenizer when the directory holds one (built-in models), else the
    directory's Hugging Face tokenizer."""
    if (Path(directory) / TOKENIZER_FILE).is_file():
        return CharTokenizer.load(directory)
    return HFTokenizer(directory)


assert set(string.digits + "+-*=") <= set(CHARSET)  # the arithmetic task's alphabet
