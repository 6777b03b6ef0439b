"""Prompts for the RL loop: a synthetic task generated on the fly, or a local jsonl / parquet file
read through HF datasets. Either way the loop sees `Problem`s: the prompt text (for the reward),
its token ids (chat template applied or not, as the recipe says) and the reference answer.

A file is read once, filtered, and served in epochs, each shuffled with `shuffle_seed + epoch`
(or in file order when `shuffle_seed` is null). Rows that cannot be trained on (missing or
non-text prompt / answer, empty prompt, prompt longer than the context leaves room for) are
skipped and counted in `skipped`, never silently: the loop logs the counts once at start.
The source's position is a single integer (`consumed`), so a resumed run continues exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple, Protocol

from miles_like.errors import RecipeError
from miles_like.tasks import arith, chain


class Problem(NamedTuple):
    prompt: str  # as in the data, before the chat template (what rewards see)
    prompt_ids: list[int]  # what the engine sees
    answer: str


class PromptTokenizer(Protocol):
    def encode_prompt(self, prompt: str, chat_template: bool) -> list[int]: ...


def read_table(data):
    """The data file as an HF datasets table, its prompt and answer columns checked (also run
    by `--dry-run` before anything starts, so both fail alike)."""
    import datasets  # imported here: a synthetic run never pays for it

    path = Path(data.path).expanduser()
    kind = "parquet" if path.suffix == ".parquet" else "json"
    datasets.disable_progress_bars()
    try:
        table = datasets.load_dataset(kind, data_files=str(path), split="train")
    except Exception as e:  # a malformed file: name it and the reason, not a deep traceback
        raise RecipeError(
            f"data.path={str(path)!r}: cannot read it as {kind} "
            f"({type(e).__name__}: {e}); fix the file"
        ) from None
    for field, key in (("data.prompt_key", data.prompt_key), ("data.answer_key", data.answer_key)):
        if key not in table.column_names:
            raise RecipeError(
                f"{field}={key!r}: {path.name} has no such column; its columns "
                f"are {', '.join(table.column_names)}"
            )
    return table


class PromptSource:
    """An endless stream of problems: `next_batch(k)`. `data` is the recipe's data section."""

    def __init__(self, data, tokenizer: PromptTokenizer, *, seed: int, max_prompt_tokens: int):
        self.data = data
        self.tokenizer = tokenizer
        self.seed = seed
        self.max_prompt_tokens = max_prompt_tokens
        self.consumed = 0
        self.skipped: dict[str, int] = {}
        if data.synthetic is not None:
            self._rows = None
        else:
            self._rows = self._read_file(Path(data.path).expanduser())
        self._stream = self._problems()

    # ------------------------------------------------------------------------------------- file
    def _read_file(self, path: Path) -> list[Problem]:
        table = read_table(self.data)
        rows = []
        for prompt, answer in zip(table[self.data.prompt_key], table[self.data.answer_key]):
            problem = self._make(prompt, answer)
            if problem is not None:
                rows.append(problem)
        if not rows:
            raise RecipeError(
                f"data.path={str(path)!r}: no usable rows ({self.skipped}); check "
                "data.prompt_key / data.answer_key and the prompt lengths"
            )
        return rows

    def _skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1

    def _make(self, prompt, answer) -> Problem | None:
        if not isinstance(prompt, str) or not prompt.strip():
            self._skip("empty_or_non_text_prompt")
            return None
        if answer is None:
            self._skip("missing_answer")
            return None
        if not isinstance(answer, str):
            answer = str(answer)  # numeric answers (GSM8K-style files often store ints)
        ids = self.tokenizer.encode_prompt(prompt, self.data.chat_template)
        if len(ids) > self.max_prompt_tokens:
            self._skip("prompt_too_long")
            return None
        return Problem(prompt, ids, answer)

    # ----------------------------------------------------------------------------------- stream
    def _problems(self) -> Iterator[Problem]:
        if self._rows is None:
            d = self.data
            stream = (
                chain.problems(
                    self.seed,
                    chain.ChainSpec(
                        d.chain_max_ops, d.chain_continue_p, d.chain_ops, d.chain_max_value
                    ),
                )
                if d.synthetic == "chain"
                else arith.problems(self.seed, arith.ArithSpec(d.arith_digits, d.arith_ops))
            )
            for p in stream:
                problem = self._make(p.prompt, p.answer)
                if problem is None:
                    raise RecipeError(
                        "rollout.max_new_tokens leaves no room for the synthetic "
                        "prompts in the model's context; lower it"
                    )
                yield problem
        epoch = 0
        while True:
            order = list(range(len(self._rows)))
            if self.data.shuffle_seed is not None:
                random.Random(self.data.shuffle_seed + epoch).shuffle(order)
            for i in order:
                yield self._rows[i]
            epoch += 1

    @property
    def num_rows(self) -> int | None:
        """Usable rows of the file (None for a synthetic task)."""
        return None if self._rows is None else len(self._rows)

    def epoch_at(self, consumed: int) -> int:
        """The file epoch the problem after `consumed` comes from (0 for a synthetic task)."""
        return 0 if self._rows is None else consumed // len(self._rows)

    def next_batch(self, k: int) -> list[Problem]:
        out = [next(self._stream) for _ in range(k)]
        self.consumed += k
        return out

    def skip_to(self, consumed: int) -> None:
        """Continue after `consumed` problems (resume): the stream is a pure function of it."""
        if consumed < self.consumed:
            self._stream = self._problems()
            self.consumed = 0
        while self.consumed < consumed:
            next(self._stream)
            self.consumed += 1
