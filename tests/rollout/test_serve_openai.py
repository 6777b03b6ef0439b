"""The OpenAI-compatible endpoint, driven by the official `openai` client against a live uvicorn
server on 127.0.0.1 (random port), on a tiny model with a byte-level BPE tokenizer + template.

References: `Engine.generate` on the same weights (tokens, logprobs, seeds), the tokenizer
itself (text, chat template), the stop strings' definition (token-exact: ids end with the token
that completed the stop string; text cut before it).
"""

from __future__ import annotations

import json
import threading

import httpx
import openai
import pytest
import torch
from prefill_engines import MODES, prefill_on

from rollout import Engine, EngineConfig, SamplingParams
from rollout.async_engine import AsyncEngine
from rollout.serving.openai_api import chat_message
from rollout.serving.server import build_app, load_tokenizer, start_server

from tiny_hf import make_hf_model, save_bpe_tokenizer, save_hf_model

CORPUS = [
    "the cat sat on the mat and the dog ate the bone",
    "one two three four five six seven eight nine ten",
    "hello world, what is 12 + 30? it is 42.",
] * 20
MAX_LEN = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("served")
    tokenizer = save_bpe_tokenizer(directory, CORPUS, vocab_size=300)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    save_hf_model(make_hf_model("qwen2", vocab_size=len(tokenizer), eos_token_id=eos), directory)
    return directory


def _engine(model_dir) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(model_dir),
            kv_cache_tokens=8192,
            page_size=4,
            max_model_len=MAX_LEN,
            max_running_requests=64,
        )
    )


PREFILLED: list = []  # the served engines whose prompts another engine prefills


@pytest.fixture(scope="module", params=MODES)
def served(model_dir, request):
    """The endpoint over one engine, or (prefill_decode) over a decode engine whose prompts a
    second engine prefills."""
    async_engine = AsyncEngine(_engine(model_dir))
    prefiller = AsyncEngine(_engine(model_dir)) if request.param == "prefill_decode" else None
    tokenizer = load_tokenizer(model_dir)
    prefill = prefill_on(prefiller) if prefiller is not None else None
    handle = start_server(build_app(async_engine, tokenizer, "tiny", prefill=prefill))
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="none", max_retries=0)
    if prefiller is not None:
        PREFILLED.append(async_engine)
    yield async_engine, tokenizer, client, handle.url
    handle.stop()
    async_engine.close()
    if prefiller is not None:
        prefiller.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    return _engine(model_dir)


def test_models_and_health(served):
    _, _, client, url = served
    assert [m.id for m in client.models.list()] == ["tiny"]
    assert httpx.get(url + "/health").json()["status"] == "ok"


def test_completion_seeded_n_logprobs_token_ids_equal_the_engine(served, reference):
    _, tokenizer, client, _ = served
    prompt = "the cat sat on"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    kwargs = {
        "model": "tiny",
        "n": 3,
        "max_tokens": 10,
        "temperature": 0.9,
        "top_p": 0.95,
        "seed": 7,
        "logprobs": 0,
        "extra_body": {"ignore_eos": True},
    }
    first = client.completions.create(prompt=prompt, **kwargs)
    again = client.completions.create(prompt=ids, **kwargs)  # token ids in, same result
    want = reference.generate(
        [ids],
        SamplingParams(
            n=3, max_new_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True
        ),
    )[0]
    assert len(first.choices) == 3
    for got, twice, ref in zip(first.choices, again.choices, want):
        assert got.prompt_token_ids == ids
        assert got.token_ids == twice.token_ids == ref.token_ids
        assert got.text == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        assert got.finish_reason == "length"
        torch.testing.assert_close(got.logprobs.token_logprobs, ref.logprobs, rtol=0, atol=1e-5)
        assert len(got.logprobs.tokens) == len(ref.token_ids)
    assert len({tuple(c.token_ids) for c in first.choices}) > 1  # n samples differ
    assert first.weight_version == 0
    assert first.usage.completion_tokens == 30 and first.usage.prompt_tokens == len(ids)
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # same prompt: prefix reused


def test_stop_string_is_token_exact(served, reference):
    _, tokenizer, client, _ = served
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    full = reference.generate([ids], params)[0][0].token_ids
    text = tokenizer.decode(full, skip_special_tokens=True)
    # a stop string taken from the middle of what the model writes with this seed
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    first_at = text.find(stop)
    # the token that completes the stop string: the shortest prefix whose text contains it
    k = next(
        k
        for k in range(1, len(full) + 1)
        if stop in tokenizer.decode(full[:k], skip_special_tokens=True)
    )
    out = client.completions.create(
        model="tiny",
        prompt=ids,
        max_tokens=40,
        seed=3,
        stop=[stop, "never-appears"],
        extra_body={"ignore_eos": True},
    ).choices[0]
    assert out.token_ids == full[:k]
    assert out.text == text[:first_at]
    assert out.finish_reason == "stop"


def test_chat_uses_the_template_and_equals_the_engine(served, reference):
    _, tokenizer, client, _ = served
    messages = [
        {"role": "system", "content": "you add numbers"},
        {"role": "user", "content": "what is 12 + 30?"},
    ]
    out = client.chat.completions.create(
        model="tiny", messages=messages, n=2, max_tokens=12, seed=5, logprobs=True, temperature=1.0
    )
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    want = reference.generate([ids], SamplingParams(n=2, max_new_tokens=12, seed=5))[0]
    for choice, ref in zip(out.choices, want):
        assert choice.prompt_token_ids == ids
        assert choice.token_ids == ref.token_ids
        assert choice.message.role == "assistant"
        assert choice.message.content == tokenizer.decode(ref.token_ids, skip_special_tokens=True)
        assert choice.finish_reason == ref.finish_reason
        torch.testing.assert_close(
            [t.logprob for t in choice.logprobs.content], ref.logprobs, rtol=0, atol=1e-5
        )


def test_tool_calls_in_the_template_layout_become_message_tool_calls():
    """The message shape is checked by the `openai` client's own model of a chat message; the
    calls by `rollout.chat`'s format (its inverse)."""
    from openai.types.chat import ChatCompletionMessage

    from rollout.chat import assistant_text

    text = assistant_text(
        "let me compute", [("calculator", {"expression": "12*34"}), ("echo", {"text": "é"})]
    )
    message = ChatCompletionMessage.model_validate(chat_message(text))
    assert message.content == "let me compute"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("calculator", {"expression": "12*34"}),
        ("echo", {"text": "é"}),
    ]
    assert len({c.id for c in message.tool_calls}) == 2
    only_call = ChatCompletionMessage.model_validate(
        chat_message(assistant_text("", [("calculator", {"expression": "1+1"})]))
    )
    assert only_call.content is None and only_call.tool_calls[0].function.name == "calculator"
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert chat_message(broken) == {"role": "assistant", "content": broken}
    assert chat_message("plain answer") == {"role": "assistant", "content": "plain answer"}


BAD = [  # (route, body, status, field)
    ("completions", {"model": "gpt-9", "prompt": "hi"}, 404, "model"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": 10**6}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": [1] * (MAX_LEN + 5)}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "hi", "max_tokens": "lots"}, 400, "max_tokens"),
    ("completions", {"model": "tiny", "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("completions", {"model": "tiny", "prompt": [1, -3]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": [1, 10**6]}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "hi", "n": 0}, 400, "n"),
    ("completions", {"model": "tiny", "prompt": "hi", "n": 10_000}, 400, "n"),
    ("completions", {"model": "tiny"}, 400, "prompt"),
    ("completions", {"model": "tiny", "prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"model": "tiny", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    (
        "chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "x" * 400}]},
        400,
        "messages",
    ),
    (
        "chat/completions",
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0},
        400,
        "top_p",
    ),
]


@pytest.mark.parametrize(
    "route,body,status,field", BAD, ids=[f"{b[3]}-{i}" for i, b in enumerate(BAD)]
)
def test_bad_requests_name_the_field_and_server_keeps_serving(served, route, body, status, field):
    _, _, client, url = served
    r = httpx.post(f"{url}/v1/{route}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == field and field in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_malformed_json_is_400_and_server_keeps_serving(served):
    _, _, client, url = served
    r = httpx.post(
        f"{url}/v1/completions",
        content=b'{"model": "tiny", "prompt": ',
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="model"):
        client.completions.create(model="other", prompt="hi")
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_503_while_paused_then_served_after_resume(served):
    async_engine, _, client, url = served
    async_engine.pause()
    try:
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.body["message"] == "engine is updating weights; retry"
        assert httpx.get(url + "/health").status_code == 503
    finally:
        async_engine.resume()
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices


def test_many_concurrent_clients_are_batched(served):
    async_engine, _, client, _ = served
    before = async_engine.stats()
    outs: list = [None] * 24
    errors: list = []

    def one(i):
        try:
            outs[i] = client.completions.create(
                model="tiny",
                prompt=[3 + i, 5, 7],
                max_tokens=16,
                seed=i,
                extra_body={"ignore_eos": True},
            )
        except Exception as exc:  # noqa: BLE001 -- collected and asserted empty
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(outs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    after = async_engine.stats()
    generated = after["generated_tokens"] - before["generated_tokens"]
    steps = after["decode_steps"] - before["decode_steps"]
    # prefill-decode: each sample's first token was sampled by the prefill engine
    first_elsewhere = 24 if async_engine in PREFILLED else 0
    assert generated + first_elsewhere == 24 * 16 == sum(len(o.choices[0].token_ids) for o in outs)
    assert steps < generated / 4, (steps, generated)


def test_raw_response_shape(served):
    """Extra fields are plain JSON too (for clients other than `openai`)."""
    _, _, _, url = served
    body = httpx.post(
        f"{url}/v1/completions", json={"model": "tiny", "prompt": [4, 5, 6], "max_tokens": 3}
    ).json()
    assert json.dumps(body)
    assert body["weight_version"] == 0 and len(body["choices"][0]["token_ids"]) <= 3
