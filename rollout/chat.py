"""Chat-template token helpers over any Hugging Face tokenizer, and the tool-call format.

Token in, token out: a multi-turn rollout never decodes and re-encodes what the engine sampled.
The next turn's input is the previous tokens (ending with the template's end-of-turn token, as
the engine emits them when it stops) followed by `delta_ids`: the template's tokens for the new
messages only, plus the generation prompt.

How `delta_ids` finds those tokens: it renders the conversation without and with the new
messages, and cuts both renderings right after the last special token (the end-of-turn token in
ChatML) of the shorter one. The text before the cut must be equal in both renderings; the text
after it in the longer one is the delta, encoded alone. Because HF tokenizers split a text at
special tokens before any merge, no BPE merge can cross the cut, so the delta's tokens are the
ones a full re-encoding would give there. Whatever the template writes after the end-of-turn
token (ChatML's "\\n") lies after the cut and so belongs to the delta, never to the sampled turn.

`check_delta` compares a trajectory's tokens with the template's rendering of the whole
conversation (the `rollout/retokenize_mismatch` count). A mismatch does not mean the trajectory
is wrong: the engine may sample a token sequence that is not the tokenizer's canonical encoding
of its text (with BPE, "a" then "b" where the encoder gives "ab"; the text of a special token
spelled in plain characters; an assistant turn not in the template's tool-call layout; with a
pre-tokenizer that merges runs of newlines, as Qwen's does, a turn starting with "\n" right
after the generation prompt's "\n"). The trajectory keeps what was sampled; the check only says
the re-encoding would differ. A tokenizer that adds a prefix space to the first piece of every
text it encodes (SentencePiece with `add_prefix_space`) would make encoded deltas differ from a
full re-encoding too; the check reports that as well (byte-level BPE and our character
vocabulary add nothing).

Tool calls use the Hermes / Qwen2.5 layout, which `CHATML_TOOLS_TEMPLATE` renders:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "12*34"}}
    </tool_call>

An assistant turn's text is its content, then each call, joined by "\\n". Transformers is
imported by the caller's tokenizer only; this module needs nothing beyond the standard library.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any, NamedTuple

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# ChatML with tools, in the Qwen2.5 layout: tool definitions in the system turn, calls in the
# assistant turn (`format_tool_call`'s text exactly, the JSON as transformers' `tojson` writes
# it), consecutive tool results grouped in one user turn. Written by us for the built-in models.
CHATML_TOOLS_TEMPLATE = (
    # HF renders with trim_blocks: a newline right after a tag is emitted as {{ nl }}.
    "{% set nl = '\\n' %}"
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ nl }}{{ tool | tojson }}{% endfor %}{{ nl }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}"
    "<|im_start|>system\n{{ messages[0]['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{% if not loop.first %}{{ raise_exception('a system message must come first') }}"
    "{% endif %}"
    "{% elif m['role'] == 'user' %}<|im_start|>user\n{{ m['content'] }}<|im_end|>\n"
    "{% elif m['role'] == 'assistant' %}<|im_start|>assistant\n"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for tc in m['tool_calls'] or [] %}"
    "{% if tc['function'] is defined %}{% set tc = tc['function'] %}{% endif %}"
    "{% if m['content'] or not loop.first %}{{ nl }}{% endif %}"
    '<tool_call>\n{"name": {{ tc["name"] | tojson }}, "arguments": '
    "{% if tc['arguments'] is string %}{{ tc['arguments'] }}"
    "{% else %}{{ tc['arguments'] | tojson }}{% endif %}}\n</tool_call>"
    "{% endfor %}<|im_end|>{{ nl }}"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ nl }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>{{ nl }}{% endif %}"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def render_text(
    tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The chat template's rendering of `messages` (and `tools`) as text."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            "the tokenizer has no chat_template; give the model directory a "
            "tokenizer_config.json with one"
        )
    return tokenizer.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )


def encode_text(tokenizer, text: str) -> list[int]:
    """`text` as token ids, adding no special tokens (rendered templates carry their own)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_ids(
    tokenizer,
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The chat template's tokens for `messages`: rendered to text, then encoded without adding
    specials (the return type of `apply_chat_template(tokenize=True)` varies across
    transformers versions; this does not)."""
    return encode_text(tokenizer, render_text(tokenizer, messages, tools, add_generation_prompt))


def _special_tokens(tokenizer) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    specials = {t.content for t in added.values() if getattr(t, "special", False)}
    specials.update(getattr(tokenizer, "all_special_tokens", []) or [])
    return sorted(specials, key=len, reverse=True)


def _last_special_end(tokenizer, text: str) -> int:
    """The end offset of the last special token in `text` (its longest match there)."""
    best = -1
    for tok in _special_tokens(tokenizer):
        i = text.rfind(tok)
        if i >= 0 and i + len(tok) > best:
            best = i + len(tok)
    if best < 0:
        raise ValueError(
            "delta_ids: the rendered conversation holds no special token to cut "
            "at; the chat template must end each turn with one (e.g. <|im_end|>)"
        )
    return best


def delta_text(
    tokenizer,
    messages: Sequence[dict],
    new_messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
) -> str:
    """The text the template adds for `new_messages` (and the generation prompt) after the
    last special token of the rendering of `messages` (see the module docstring)."""
    if not messages:
        raise ValueError("delta_ids: messages is empty; render the first turn with render_ids")
    before = render_text(tokenizer, messages, tools, add_generation_prompt=False)
    after = render_text(
        tokenizer, list(messages) + list(new_messages), tools, add_generation_prompt=True
    )
    cut = _last_special_end(tokenizer, before)
    if after[:cut] != before[:cut]:
        at = next(i for i in range(cut) if i >= len(after) or after[i] != before[i])
        raise ValueError(
            f"delta_ids: the chat template renders the earlier turns differently "
            f"once new messages follow (first difference at character {at}: "
            f"{before[at : at + 30]!r} vs {after[at : at + 30]!r}); token-exact "
            "deltas need a template whose history does not change"
        )
    return after[cut:]


def delta_ids(
    tokenizer,
    messages: Sequence[dict],
    new_messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
) -> list[int]:
    """The template's tokens for `new_messages` plus the generation prompt, to append after the
    tokens of `messages` (whose last turn, sampled by the engine, ends with the end-of-turn
    token)."""
    return encode_text(tokenizer, delta_text(tokenizer, messages, new_messages, tools))


class DeltaCheck(NamedTuple):
    matches: bool
    first_difference: int | None  # token index where the two sequences first differ
    expected: list[int]  # the template's rendering of the whole conversation


def check_delta(
    tokenizer,
    token_ids: Sequence[int],
    messages: Sequence[dict],
    tools: Sequence[dict] | None = None,
    add_generation_prompt: bool = True,
) -> DeltaCheck:
    """Compare a trajectory's tokens (prompt + sampled turns + deltas) with `render_ids` of the
    whole conversation; a mismatch counts one `rollout/retokenize_mismatch`."""
    expected = render_ids(tokenizer, messages, tools, add_generation_prompt)
    got = list(token_ids)
    if got == expected:
        return DeltaCheck(True, None, expected)
    first = next(
        (i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected))
    )
    return DeltaCheck(False, first, expected)


class ToolCall(NamedTuple):
    name: str
    arguments: dict[str, Any]


class ToolCallError(ValueError):
    """A malformed tool call in an assistant turn (the message says which and why)."""


def format_tool_call(name: str, arguments: dict[str, Any]) -> str:
    """One call in the template's layout, as the template renders an assistant `tool_calls`
    entry (the JSON as transformers' `tojson` writes it: `ensure_ascii=False`, default
    separators, keys in order)."""
    if not isinstance(name, str) or not name:
        raise ToolCallError(f"tool call name={name!r}: use a non-empty string")
    if not isinstance(arguments, dict):
        raise ToolCallError(
            f"tool call {name!r}: arguments must be a dict, not {type(arguments).__name__}"
        )
    body = {"name": name, "arguments": arguments}
    return f"{TOOL_CALL_OPEN}\n{json.dumps(body, ensure_ascii=False)}\n{TOOL_CALL_CLOSE}"


def assistant_text(content: str, calls: Sequence[ToolCall] = ()) -> str:
    """An assistant turn's text as the template renders it: content, then each call, joined by
    a newline (what a model following the template samples before its end-of-turn token)."""
    parts = ([content] if content else []) + [format_tool_call(*c) for c in calls]
    return "\n".join(parts)


def assistant_message(content: str, calls: Sequence[ToolCall] = ()) -> dict[str, Any]:
    """The OpenAI-style assistant message for a turn (the template renders it back into
    `assistant_text(content, calls)`)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in calls
        ]
    return msg


_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.DOTALL)


def _parse_call(index: int, body: str) -> ToolCall:
    where = f"tool call {index}"
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        raise ToolCallError(
            f"{where}: invalid JSON ({e.msg} at character {e.pos}) in {body.strip()[:80]!r}"
        ) from None
    if not isinstance(obj, dict):
        raise ToolCallError(
            f"{where}: expected a JSON object with 'name' and 'arguments', got {type(obj).__name__}"
        )
    extra = set(obj) - {"name", "arguments"}
    if extra:
        raise ToolCallError(
            f"{where}: unexpected keys {sorted(extra)}; a call has only 'name' and 'arguments'"
        )
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ToolCallError(
            f"{where}: missing 'name' (a non-empty string)"
            if name is None
            else f"{where}: 'name' must be a non-empty string, got {name!r}"
        )
    arguments = obj.get("arguments", {})
    if not isinstance(arguments, dict):
        raise ToolCallError(
            f"{where} ({name}): 'arguments' must be a JSON object, got {type(arguments).__name__}"
        )
    return ToolCall(name, arguments)


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Split an assistant turn's text into its content and its tool calls.

    Inverse of `assistant_text`: content is the text before the first call (less the newline
    joining it to the call); only whitespace may lie between and after calls. Raises
    `ToolCallError` naming the call (1-based) and the fault: invalid JSON, a missing or empty
    name, arguments that are not an object, an unclosed tag, text after a call."""
    calls: list[ToolCall] = []
    pos = 0
    first = None
    for m in _CALL.finditer(text):
        if first is None:
            first = m.start()
        elif text[pos : m.start()].strip():
            raise ToolCallError(
                f"tool call {len(calls)}: text between tool calls "
                f"{text[pos : m.start()].strip()[:40]!r}; put content first"
            )
        calls.append(_parse_call(len(calls) + 1, m.group(1)))
        pos = m.end()
    rest = text[pos:]
    if TOOL_CALL_OPEN in rest:
        raise ToolCallError(
            f"tool call {len(calls) + 1}: {TOOL_CALL_OPEN} without {TOOL_CALL_CLOSE}"
        )
    if first is None:
        if TOOL_CALL_CLOSE in text:
            raise ToolCallError(f"tool call 1: {TOOL_CALL_CLOSE} without {TOOL_CALL_OPEN}")
        return text, []
    if TOOL_CALL_CLOSE in rest or rest.strip():
        raise ToolCallError(
            f"tool call {len(calls)}: text after the last tool call "
            f"{rest.strip()[:40]!r}; a turn ends with its calls"
        )
    content = text[:first]
    return content.removesuffix("\n"), calls
