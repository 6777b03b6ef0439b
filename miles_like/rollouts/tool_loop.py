"""The built-in multi-turn rollout function (`rollout.function: tool_loop`): the model calls the
recipe's tools (`rollout.tools`, run by `tools.ToolPool`) until it answers.

For each of the group's n samples, concurrently:

    prompt -> [model turn -> its tool calls run -> their results appended] ... -> final answer

A model turn that stops with tool calls in the chat template's tool-call format
(`rollout.chat.parse_tool_calls`) has them run; their results become tool messages whose tokens
are `chat.delta_ids(...)` of the conversation: the template's tokens for the new messages and
the next generation prompt, appended after the sampled tokens. Sampled tokens are never decoded
and re-encoded (decoding is only for reading the calls). A malformed call is answered with an
error tool message (the model may try again). The trajectory ends at the first turn without a
tool call (the final answer), a turn cut by the token budget, or after `ctx.max_turns` model
turns; a last turn's calls are not run (no turn is left to read their results).

Budgets: a turn samples at most `rollout.max_new_tokens`; a trajectory holds at most
`rollout.max_trajectory_tokens` tokens after its prompt (sampled + appended) and never more than
the context. When a tool's result does not fit, the trajectory ends before it.

The reward is the recipe's reward function on the final answer's text ("" when there is none).
Metrics per trajectory: turns, tool_calls, tool_errors (and tool_errors_<kind> for each kind of
`tools.ERROR_KINDS` plus `bad_call`, a malformed call), retokenize_mismatch (1 when the
template's rendering of the whole conversation differs from the trajectory's tokens: the model
sampled something that is not the canonical encoding of its text, e.g. a call's JSON spaced
otherwise than the template writes it).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any

from miles_like.data import Problem
from miles_like.rollouts.tools import ERROR_KINDS, ToolResult
from miles_like.rollouts.trajectory import Trajectory, TrajectoryBuilder
from rollout import chat

BAD_CALL = "bad_call"  # the model's call did not parse (chat.ToolCallError)
ERROR_METRICS = tuple(f"tool_errors_{k}" for k in (*ERROR_KINDS, BAD_CALL))


def hf_tokenizer(tokenizer):
    """The transformers tokenizer behind our wrapper (`tokenizer.HFTokenizer.tok`), or itself."""
    return getattr(tokenizer, "tok", tokenizer)


class Conversation:
    """A trajectory and the messages it renders, kept in step: `assistant` appends a sampled
    turn, `append` the template's tokens for new messages."""

    def __init__(
        self,
        tokenizer,
        prompt: str,
        prompt_ids: list[int],
        tools: list[dict] | None,
        max_response_tokens: int,
    ):
        self.tok = hf_tokenizer(tokenizer)
        self.tools = tools
        self.messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}]
        self.builder = TrajectoryBuilder(prompt_ids)
        self.max_len = len(prompt_ids) + max_response_tokens

    def room(self, context_room: int) -> int:
        return min(context_room, self.max_len - len(self.builder.token_ids))

    def assistant(self, generation) -> tuple[str, list[chat.ToolCall] | None, str | None]:
        """Append a sampled turn: (content, calls, parse error). `calls` is None when the turn
        was cut (no end-of-turn token: nothing in it is read as a call)."""
        self.builder.sampled(
            generation.token_ids,
            generation.logprobs,
            generation.weight_version,
            generation.finish_reason,
            versions=generation.versions,
            routes=generation.routes,
        )
        text = self.tok.decode(generation.token_ids, skip_special_tokens=True)
        if generation.finish_reason != "stop":
            self.messages.append(chat.assistant_message(text))
            return text, None, None
        try:
            content, calls = chat.parse_tool_calls(text)
        except chat.ToolCallError as e:
            self.messages.append(chat.assistant_message(text))
            return text, [], str(e)
        self.messages.append(chat.assistant_message(content, calls))
        return content, calls, None

    def demonstrated(self, message: dict[str, Any]) -> None:
        """Append an assistant message as the model should sample it (a warm-start target):
        its text in the template's layout, then the end-of-turn token; mask 1."""
        calls = [
            chat.ToolCall(c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []
        ]
        ids = chat.encode_text(self.tok, chat.assistant_text(message["content"], calls))
        ids.append(self.tok.eos_token_id)
        self.builder.sampled(ids, [0.0] * len(ids), 0)
        self.messages.append(chat.assistant_message(message["content"], calls))

    def append(self, new_messages: list[dict[str, Any]], room: int) -> bool:
        """Append the template's tokens for `new_messages` (and the generation prompt); False,
        appending nothing, when they would leave no room for a token of the next turn."""
        ids = chat.delta_ids(self.tok, self.messages, new_messages, self.tools)
        if len(ids) >= room:
            return False
        self.builder.appended(ids)
        self.messages.extend(new_messages)
        return True

    def retokenize_mismatch(self) -> bool:
        """The template's rendering of the conversation differs from the tokens. The rendering
        of a finished conversation goes on after the last end-of-turn token (ChatML's "\\n"),
        so the tokens must be its prefix."""
        tokens = self.builder.token_ids
        expected = chat.render_ids(self.tok, self.messages, self.tools, add_generation_prompt=False)
        return expected[: len(tokens)] != tokens


def prompt_ids(tokenizer, problem: Problem, tools: list[dict] | None) -> list[int]:
    """The first turn's input: the problem's own ids, or rendered again with the tools'
    schemas in the system turn."""
    if tools is None:
        return list(problem.prompt_ids)
    return chat.render_ids(
        hf_tokenizer(tokenizer), [{"role": "user", "content": problem.prompt}], tools
    )


def demonstration(
    tokenizer, problem: Problem, messages: list[dict[str, Any]], tools: list[dict] | None
) -> Trajectory:
    """A warm-start sample: the prompt, then `messages` (the solution's assistant turns, mask 1,
    and the tool results between them, mask 0) tokenized exactly as `tool_loop` would."""
    ids = prompt_ids(tokenizer, problem, tools)
    conv = Conversation(tokenizer, problem.prompt, ids, tools, max_response_tokens=1 << 30)
    pending: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            conv.append(pending, room=1 << 30)
            pending = []
        conv.demonstrated(m)
    if pending:
        raise ValueError("a demonstration ends with an assistant message")
    return conv.builder.build(response_text=messages[-1]["content"])


def _tool_message(call: chat.ToolCall, result: ToolResult) -> dict[str, Any]:
    return {"role": "tool", "name": call.name, "content": result.content}


async def _sample(ctx, problem: Problem, j: int, settings) -> Trajectory:
    pool = ctx.tool_pool
    tools = prompt_tools(pool.schemas if pool is not None else [], settings)
    conv = Conversation(
        ctx.tokenizer,
        problem.prompt,
        prompt_ids(ctx.tokenizer, problem, tools),
        tools,
        settings.max_trajectory_tokens or 1 << 30,
    )
    errors: Counter = Counter()
    calls_made, final = 0, None
    for turn in range(ctx.max_turns):
        room = conv.room(ctx.room(conv.builder.token_ids))
        if room < 1:
            conv.builder.finish_reason = "length"
            break
        params = ctx.sampling(j, turn)
        params = dataclasses.replace(params, max_new_tokens=min(params.max_new_tokens, room))
        generation = await ctx.generate(conv.builder.token_ids, params)
        content, calls, parse_error = conv.assistant(generation)
        if calls is None:
            break  # cut by the budget: no final answer
        if not calls and parse_error is None:
            final = content
            break
        if turn == ctx.max_turns - 1:
            break  # no turn left to read the results
        if parse_error is not None:
            errors[BAD_CALL] += 1
            replies = [{"role": "tool", "name": "error", "content": f"error: {parse_error}"}]
        else:
            calls_made += len(calls)
            results = await asyncio.gather(*(_run(pool, c) for c in calls))
            errors.update(r.error for r in results if r.error is not None)
            replies = [_tool_message(c, r) for c, r in zip(calls, results)]
        if not conv.append(replies, conv.room(ctx.room(conv.builder.token_ids))):
            conv.builder.finish_reason = "length"
            break
    reward = await ctx.reward(problem, final if final is not None else "")
    metrics = {
        "tool_calls": float(calls_made),
        "tool_errors": float(sum(errors.values())),
        **{f"tool_errors_{k}": float(errors[k]) for k in (*ERROR_KINDS, BAD_CALL)},
        "retokenize_mismatch": float(conv.retokenize_mismatch()),
    }
    return conv.builder.build(response_text=final or "", reward=reward, metrics=metrics)


async def _run(pool, call: chat.ToolCall) -> ToolResult:
    if pool is None:
        return ToolResult(f"error: unknown tool {call.name!r} (tools: none)", "unknown")
    return await pool.acall(call.name, call.arguments)


def prompt_tools(schemas: list[dict], rollout) -> list[dict] | None:
    """The tools' schemas the chat template shows (`rollout.tool_schemas_in_prompt`), or None.
    `rollout` is the recipe's rollout section."""
    return list(schemas) if schemas and rollout.tool_schemas_in_prompt else None


async def tool_loop(ctx, problem: Problem) -> list[Trajectory]:
    """The group's n trajectories, sampled concurrently (their requests batch in the engine)."""
    settings = ctx.settings  # the recipe's rollout section
    return list(await asyncio.gather(*(_sample(ctx, problem, j, settings) for j in range(ctx.n))))
