"""The rest of the OpenAI surface, driven by the official `openai` client against a live server
(float64 engine) on a tiny model with a byte-level BPE tokenizer + chat template:

* `logprobs=5` completions and `top_logprobs=5` chat: the alternatives are the true top-5 of
  log_softmax(logits / T) over the full vocabulary, checked against an exact float64 HF forward
  on the same weights; the sampled token's log-prob equals the engine's (`Engine.generate`);
* `echo` with prompt log-probs (the first None), against the same HF forward;
* `stream=True` on both routes: the concatenated token ids (and text) equal the non-streamed
  response for the same seed, the finish reason is in the last content chunk, and with
  `stream_options.include_usage` a last chunk carries the usage;
* `/tokenize`, `/detokenize` (the tokenizer itself) and `/metrics` (Prometheus text, parsed);
* API keys: right key, wrong key, no key (401 in OpenAI's shape; /health open), and the refusal
  to bind 0.0.0.0 without a key (one line), by `start_server` and by the CLI.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
import torch
from exact_float64 import exact_float64
from prefill_engines import MODES, prefill_on

from rollout import Engine, EngineConfig, SamplingParams
from rollout.async_engine import AsyncEngine
from rollout.serving.server import build_app, load_tokenizer, start_server

from tiny_hf import make_hf_model, save_bpe_tokenizer, save_hf_model

CORPUS = [
    "the cat sat on the mat and the dog ate the bone",
    "one two three four five six seven eight nine ten",
    "hello world, what is 12 + 30? it is 42.",
] * 20
MAX_LEN = 160
ATOL = 1e-10  # float64 engine vs exact-float64 HF
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("surface")
    tokenizer = save_bpe_tokenizer(directory, CORPUS, vocab_size=300)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    hf = make_hf_model("qwen2", vocab_size=len(tokenizer), eos_token_id=eos, dtype=torch.float64)
    save_hf_model(hf, directory)
    return directory, exact_float64(hf)


def _engine(directory) -> Engine:
    return Engine(
        EngineConfig(
            model_path=str(directory),
            dtype="float64",
            kv_cache_tokens=4096,
            page_size=4,
            max_model_len=MAX_LEN,
            max_running_requests=16,
        )
    )


@pytest.fixture(scope="module", params=MODES)
def served(model_dir, request):
    """The endpoint over one engine, or (prefill_decode) over a decode engine whose prompts a
    second engine prefills (what it cannot prefill yet, top and prompt log-probs, the decode
    engine serves whole)."""
    directory, _ = model_dir
    async_engine = AsyncEngine(_engine(directory))
    prefiller = AsyncEngine(_engine(directory)) if request.param == "prefill_decode" else None
    tokenizer = load_tokenizer(directory)
    prefill = prefill_on(prefiller) if prefiller is not None else None
    handle = start_server(build_app(async_engine, tokenizer, "tiny", prefill=prefill))
    client = openai.OpenAI(base_url=handle.url + "/v1", api_key="none", max_retries=0)
    yield tokenizer, client, handle.url
    handle.stop()
    async_engine.close()
    if prefiller is not None:
        prefiller.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    return _engine(model_dir[0])


def _hf_logprobs(hf, ids: list[int], temperature: float) -> torch.Tensor:
    """[len(ids), V] log_softmax(logits / T) in float64, T exactly as given."""
    with torch.inference_mode():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return torch.log_softmax(logits / (temperature or 1.0), dim=-1)


def _text(tokenizer, token: int) -> str:
    return tokenizer.decode([token], skip_special_tokens=True)


def test_completion_logprobs_5_are_the_true_top_5(served, model_dir, reference, request):
    tokenizer, client, _ = served
    hf = model_dir[1]
    prompt = "the cat sat on"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=8,
        temperature=0.8,
        seed=4,
        logprobs=5,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    (ref,) = reference.generate(
        [ids], SamplingParams(max_new_tokens=8, temperature=0.8, seed=4, ignore_eos=True)
    )
    assert choice.token_ids == ref[0].token_ids
    if request.node.callspec.params["served"] == "one_engine":
        assert choice.logprobs.token_logprobs == ref[0].logprobs  # exactly the engine's
    else:
        # the decode engine's prefix cache holds K/V the prefill engine computed in other
        # batches (earlier tests' handoffs): float64 equal to rounding, PD's bound
        assert choice.logprobs.token_logprobs == pytest.approx(ref[0].logprobs, rel=0, abs=1e-12)
    hf_lp = _hf_logprobs(hf, ids + choice.token_ids, 0.8)
    text_offset = 0
    for i, token in enumerate(choice.token_ids):
        row = hf_lp[len(ids) - 1 + i]
        values, order = row.topk(5)
        top = choice.logprobs.top_logprobs[i]
        # keyed by text: HF's top 5 in descending order (a text several tokens share keeps the
        # likeliest), and the sampled token always (OpenAI: up to logprobs + 1 entries)
        want: dict[str, float] = {}
        for t, v in zip(order.tolist(), values.tolist()):
            want.setdefault(_text(tokenizer, t), v)
        want.setdefault(_text(tokenizer, token), float(row[token]))
        assert top.keys() == want.keys()
        assert all(abs(top[k] - want[k]) < ATOL for k in want)
        assert len(top) <= 6
        assert choice.logprobs.text_offset[i] == text_offset
        text_offset += len(choice.logprobs.tokens[i])


def test_chat_top_logprobs_5_are_the_true_top_5(served, model_dir):
    tokenizer, client, _ = served
    hf = model_dir[1]
    messages = [{"role": "user", "content": "one two three"}]
    out = client.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    prompt = out.choices[0].model_extra["prompt_token_ids"]
    tokens = choice.model_extra["token_ids"]
    assert prompt == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    hf_lp = _hf_logprobs(hf, prompt + tokens, 0.0)
    for i, (token, entry) in enumerate(zip(tokens, choice.logprobs.content)):
        row = hf_lp[len(prompt) - 1 + i]
        values, order = row.topk(5)
        assert [a.token for a in entry.top_logprobs] == [
            _text(tokenizer, t) for t in order.tolist()
        ]
        got = torch.tensor([a.logprob for a in entry.top_logprobs], dtype=torch.float64)
        assert torch.allclose(got, values, atol=ATOL, rtol=0)
        assert entry.logprob == pytest.approx(float(row[token]), abs=ATOL)
        assert int(order[0]) == token  # greedy: the sampled token is the top one


def test_echo_carries_prompt_logprobs(served, model_dir):
    tokenizer, client, _ = served
    hf = model_dir[1]
    prompt = "hello world, what is"
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    out = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=4, echo=True, logprobs=2, seed=1
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(tokenizer.decode(ids))
    assert len(lp.tokens) == len(ids) + len(choice.token_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _hf_logprobs(hf, ids, 1.0)
    for i in range(1, len(ids)):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, ids[i]]), abs=ATOL)
    assert lp.text_offset[len(ids)] == len(tokenizer.decode(ids))


def _collect(events, chat: bool):
    """(token ids per choice, text per choice, finish reasons, usage, last content chunk index)."""
    ids: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    chunks = list(events)
    for k, chunk in enumerate(chunks):
        if chunk.usage is not None:
            usage = chunk.usage
            assert not chunk.choices and k == len(chunks) - 1
        for c in chunk.choices:
            assert c.index not in reasons, "a chunk after the choice's finish reason"
            ids.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            piece = c.delta.content if chat else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason is not None:
                reasons[c.index] = c.finish_reason
    return ids, texts, reasons, usage, len(chunks)


def test_streamed_completion_equals_non_streamed(served):
    _, client, _ = served
    kw = dict(model="tiny", prompt=["the dog ate", "one two"], max_tokens=12, n=2, seed=7)
    whole = client.completions.create(**kw)
    ids, texts, reasons, usage, chunks = _collect(
        client.completions.create(stream=True, stream_options={"include_usage": True}, **kw),
        chat=False,
    )
    assert chunks > 4  # incremental: more than one chunk per choice
    for c in whole.choices:
        assert ids[c.index] == c.token_ids
        assert texts[c.index] == c.text
        assert reasons[c.index] == c.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_streamed_chat_equals_non_streamed(served):
    _, client, _ = served
    kw = dict(
        model="tiny",
        messages=[{"role": "user", "content": "hello world"}],
        max_tokens=16,
        seed=3,
        stop=["the"],
    )
    whole = client.chat.completions.create(**kw)
    ids, texts, reasons, usage, _ = _collect(
        client.chat.completions.create(
            stream=True,
            stream_options={"include_usage": True},
            logprobs=True,
            top_logprobs=2,
            **kw,
        ),
        chat=True,
    )
    c = whole.choices[0]
    assert ids[0] == c.model_extra["token_ids"]
    assert texts[0] == c.message.content
    assert reasons[0] == c.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stream_without_usage_has_no_usage_chunk(served):
    _, client, _ = served
    chunks = list(client.completions.create(model="tiny", prompt="hi", max_tokens=3, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason is not None


def test_tokenize_detokenize_and_metrics(served):
    tokenizer, client, url = served
    r = httpx.post(url + "/tokenize", json={"model": "tiny", "prompt": "the cat sat"}).json()
    assert r["tokens"] == tokenizer.encode("the cat sat") and r["count"] == len(r["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(url + "/tokenize", json={"messages": messages}).json()
    assert r["tokens"] == tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert r["max_model_len"] == MAX_LEN
    back = httpx.post(url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert back == tokenizer.decode(r["tokens"], skip_special_tokens=True)
    bad = httpx.post(url + "/tokenize", json={"model": "tiny"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"

    client.completions.create(model="tiny", prompt="the cat", max_tokens=3)
    text = httpx.get(url + "/metrics")
    assert text.headers["content-type"].startswith("text/plain")
    samples = {}
    for line in text.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    label = 'model_name="tiny"'
    assert samples[f"miles_like_generation_tokens_total{{{label}}}"] >= 3
    assert samples[f"miles_like_num_requests_running{{{label}}}"] == 0
    assert 0 <= samples[f"miles_like_prefix_cache_hit_rate{{{label}}}"] <= 1
    key = f'miles_like_requests_total{{{label},route="/v1/completions",status="200"}}'
    assert samples[key] >= 1


@pytest.fixture(scope="module")
def keyed(model_dir):
    directory, _ = model_dir
    async_engine = AsyncEngine(_engine(directory))
    handle = start_server(build_app(async_engine, load_tokenizer(directory), "tiny", KEY))
    yield handle.url
    handle.stop()
    async_engine.close()


def test_api_key_right_wrong_none(keyed):
    url = keyed
    right = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert right.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
    assert [m.id for m in right.models.list()] == ["tiny"]
    chunks = list(right.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True))
    assert chunks
    wrong = openai.OpenAI(base_url=url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
    none = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
    assert none.status_code == 401
    assert set(none.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # open, as vLLM's


def test_binding_beyond_loopback_needs_a_key(served, model_dir):
    from fastapi import FastAPI

    with pytest.raises(ValueError, match=r"^refusing to serve on 0\.0\.0\.0 without an API key"):
        start_server(FastAPI(), "0.0.0.0", 0)
    cli = subprocess.run(
        [sys.executable, "-m", "rollout.serving.server", str(model_dir[0]), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 2
    (line,) = cli.stderr.strip().splitlines()
    assert "without an API key" in line and "--api-key" in line
    router = subprocess.run(
        [sys.executable, "-m", "rollout.serving.router_app", "--replica", "http://127.0.0.1:1"]
        + ["--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert router.returncode == 2 and "--api-key" in router.stderr.strip().splitlines()[-1]


def test_router_with_a_key_relays_streams(served):
    """The router front: its own key (right, wrong, none), plain and streamed calls through it
    equal to the replica's own answers."""
    from rollout.serving.router import Router
    from rollout.serving.router_app import build_router_app

    tokenizer, client, url = served
    front = start_server(build_router_app([url], Router(1), tokenizer, api_key=KEY))
    try:
        routed = openai.OpenAI(base_url=front.url + "/v1", api_key=KEY, max_retries=0)
        kw = dict(model="tiny", prompt="one two", max_tokens=8, seed=2)
        direct = client.completions.create(**kw).choices[0]
        assert routed.completions.create(**kw).choices[0].token_ids == direct.token_ids
        ids, texts, _, usage, _ = _collect(
            routed.completions.create(stream=True, stream_options={"include_usage": True}, **kw),
            chat=False,
        )
        assert ids[0] == direct.token_ids and texts[0] == direct.text
        assert usage.completion_tokens == len(direct.token_ids)
        wrong = openai.OpenAI(base_url=front.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.completions.create(**kw)
        assert httpx.post(front.url + "/v1/completions", json=kw).status_code == 401
        assert httpx.get(front.url + "/health").status_code == 200
    finally:
        front.stop()


def test_a_client_gone_mid_stream_aborts_its_request(served):
    import time

    _, client, url = served
    generated = 'miles_like_generated_tokens_total{model_name="tiny"}'

    def metric(name: str) -> float:
        lines = httpx.get(url + "/metrics").text.splitlines()
        (line,) = [x for x in lines if x.startswith(name)]
        return float(line.rsplit(" ", 1)[1])

    before = metric(generated)
    stream = client.completions.create(
        model="tiny",
        prompt="the cat",
        max_tokens=150,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    gauge = 'miles_like_num_requests_in_flight{model_name="tiny"}'
    deadline = time.monotonic() + 30
    while metric(gauge) != 0:
        assert time.monotonic() < deadline, "the request still runs after its client left"
        time.sleep(0.05)
    assert metric(generated) - before < 150  # aborted before its max_tokens
