"""The prompt source: file reading through HF datasets, counted skips, epochs, resume position."""

from __future__ import annotations

import json

import pytest

from miles_like.data import PromptSource
from miles_like.models.tokenizer import builtin_tokenizer
from miles_like.recipe import RecipeError
from miles_like.recipe.sections import DataSection
from miles_like.tasks import arith

TOK = builtin_tokenizer()


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def source(data, max_prompt_tokens=64, seed=0):
    return PromptSource(data, TOK, seed=seed, max_prompt_tokens=max_prompt_tokens)


def test_synthetic_stream_is_the_arith_task_with_template(tmp_path):
    data = DataSection(synthetic="arith", arith_digits=3, arith_ops="+*", chat_template=True)
    got = source(data, seed=11).next_batch(20)
    expected = [p for p, _ in zip(arith.problems(11, arith.ArithSpec(3, "+*")), range(20))]
    assert [(g.prompt, g.answer) for g in got] == [(e.prompt, e.answer) for e in expected]
    chatml = f"<|im_start|>user\n{expected[0].prompt}<|im_end|>\n<|im_start|>assistant\n"
    assert got[0].prompt_ids == TOK.tok.encode(chatml, add_special_tokens=False)


def test_file_rows_are_filtered_and_counted(tmp_path):
    rows = [
        {"q": "1+1=", "a": "2"},
        {"q": "", "a": "0"},
        {"q": "x" * 100, "a": "1"},
        {"q": "2+2=", "a": 4},
        {"q": "3+3=", "a": None},
        {"q": 5, "a": "5"},
    ]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    data = DataSection(
        path=str(path), prompt_key="q", answer_key="a", chat_template=False, shuffle_seed=None
    )
    src = source(data, max_prompt_tokens=50)
    assert src.skipped == {"empty_or_non_text_prompt": 2, "prompt_too_long": 1, "missing_answer": 1}
    got = src.next_batch(5)
    # file order, numeric answers as text, epochs wrap around
    assert [(p.prompt, p.answer) for p in got] == [
        ("1+1=", "2"),
        ("2+2=", "4"),
        ("1+1=", "2"),
        ("2+2=", "4"),
        ("1+1=", "2"),
    ]
    assert got[0].prompt_ids == TOK.tok.encode("1+1=", add_special_tokens=False)


def test_epochs_are_shuffled_by_seed_and_resume_continues_exactly(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl", [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(10)]
    )
    data = DataSection(path=str(path), shuffle_seed=3)
    a = source(data).next_batch(25)
    first_epoch = [p.answer for p in a[:10]]
    assert sorted(first_epoch, key=int) == [str(i) for i in range(10)]
    assert first_epoch != [str(i) for i in range(10)]  # shuffled
    assert [p.answer for p in a[10:20]] != first_epoch  # a new order each epoch
    resumed = source(data)
    resumed.skip_to(13)
    assert resumed.next_batch(12) == a[13:25]
    assert (resumed.num_rows, resumed.epoch_at(9), resumed.epoch_at(13)) == (10, 0, 1)


def test_missing_column_names_the_field(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2"}])
    with pytest.raises(RecipeError, match=r"data\.prompt_key='prompt'.*question"):
        source(DataSection(path=str(path)))


def test_no_usable_rows_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "", "answer": "2"}])
    with pytest.raises(RecipeError, match="no usable rows"):
        source(DataSection(path=str(path)))


def test_parquet_reads_like_jsonl(tmp_path):
    import datasets

    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "4+4=", "answer": "8"}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "d.parquet"))
    got = source(DataSection(path=str(tmp_path / "d.parquet"), shuffle_seed=None)).next_batch(2)
    assert [(p.prompt, p.answer) for p in got] == [("1+2=", "3"), ("4+4=", "8")]
