"""Rollout functions for the tests (`rollout.function: agent_rollouts:NAME`).

`three_turns`: every sample talks three turns with a deterministic "tool" that answers how many
tokens the model's last turn had; the next turn's input is the previous tokens plus the chat
template's delta for the tool's message (nothing sampled is decoded and re-encoded). Each
trajectory and what went into it is recorded in `RECORDS` for the test to rebuild by hand.
`three_turns_across_updates`: the same, its "tool" slow enough to span a weight update (fully
async runs).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import NamedTuple

from miles_like.rollouts.trajectory import TrajectoryBuilder
from rollout import chat

TURNS = 3


class Record(NamedTuple):
    prompt: str
    prompt_ids: list[int]
    sampled: list[list[int]]  # the engine's tokens, turn by turn
    logprobs: list[list[float]]
    appended: list[list[int]]  # what the function appended after each turn but the last
    trajectory: object


RECORDS: list[Record] = []


def tool_message(sampled: list[int]) -> dict:
    return {"role": "user", "content": f"tool: {len(sampled)} tokens"}


# Called once, by the first sample to finish its first turn (a test kills an engine there, so
# that every conversation on it is midway, deterministically).
AFTER_FIRST_TURN: list = []


async def three_turns(ctx, problem):
    return await _three_turns(ctx, problem, wait_for_update=False)


async def three_turns_across_updates(ctx, problem):
    """`three_turns`, but a sample whose first turn was sampled entirely by weights newer than
    the first (version >= 1) waits, as a slow tool would, for the next weight update before its
    second turn: its group is open with tokens at that update (continued across it, staleness 1
    when trained) and its trajectory holds tokens of two versions, whatever the relative speed
    of engine and trainer. Groups drawn under the initial weights never wait, so the first
    batches always complete. A group drawn late (the producer not ahead: its own batch makes
    the awaited update) cannot get that update; it goes on after `UPDATE_WAIT_S`, unmixed."""
    return await _three_turns(ctx, problem, wait_for_update=True)


# Longer than a train step and weight sync on a loaded CI box; the cost of a late group.
UPDATE_WAIT_S = 20.0


async def next_update(ctx, token_ids: list[int], j: int, version: int) -> int | None:
    """Polls the engine with one-token calls (their tokens are discarded) until it samples with
    weights newer than `version`; returns that version, or None after `UPDATE_WAIT_S`."""
    poll = dataclasses.replace(ctx.sampling(j), max_new_tokens=1)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + UPDATE_WAIT_S
    while loop.time() < deadline:
        g = await ctx.generate(token_ids, poll)
        if min(g.versions or (g.weight_version,)) > version:
            return g.weight_version
        await asyncio.sleep(0.02)
    return None


async def _three_turns(ctx, problem, wait_for_update: bool):
    tok = ctx.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    async def sample(j: int):
        b = TrajectoryBuilder(problem.prompt_ids)
        messages = [{"role": "user", "content": problem.prompt}]
        sampled, logprobs, appended = [], [], []
        mismatches = 0
        for turn in range(TURNS):
            g = await ctx.generate(b.token_ids, ctx.sampling(j, turn))
            b.sampled(
                g.token_ids, g.logprobs, g.weight_version, g.finish_reason, g.versions, g.routes
            )
            if AFTER_FIRST_TURN:
                AFTER_FIRST_TURN.pop()()
            oldest = min(g.versions or (g.weight_version,))
            if wait_for_update and turn == 0 and oldest >= 1:
                await next_update(ctx, b.token_ids, j, max(g.versions or (g.weight_version,)))
            sampled.append(g.token_ids)
            logprobs.append(g.logprobs)
            messages.append(
                {"role": "assistant", "content": tok.decode(g.token_ids, skip_special_tokens=True)}
            )
            if turn == TURNS - 1:
                break
            extra = [] if g.token_ids[-1] == eos else [eos]  # a truncated turn still ends
            new = [tool_message(g.token_ids)]
            extra += chat.delta_ids(tok, messages, new)
            b.appended(extra)
            appended.append(extra)
            messages += new
            mismatches += not chat.check_delta(tok, b.token_ids, messages).matches
        t = b.build(
            response_text=messages[-1]["content"],
            metrics={"tool_calls": float(TURNS - 1), "retokenize_mismatch": mismatches},
        )
        RECORDS.append(
            Record(problem.prompt, list(problem.prompt_ids), sampled, logprobs, appended, t)
        )
        return t

    return list(await asyncio.gather(*(sample(j) for j in range(ctx.n))))


async def raises(ctx, problem):
    raise KeyError("no such tool")


async def too_few(ctx, problem):
    return []


async def bad_mask(ctx, problem):
    (g,) = [await ctx.generate(problem.prompt_ids, ctx.sampling(0))]
    b = TrajectoryBuilder(problem.prompt_ids)
    b.sampled(g.token_ids, g.logprobs, g.weight_version)
    t = b.build(response_text="")
    return [dataclasses.replace(t, loss_mask=t.loss_mask + (1,))] * ctx.n


def not_async(ctx, problem):
    return []


async def openai_agent(ctx, problem):
    """External agent code: the official `openai` client against `ctx.base_url` (the router),
    one session per sample; the trajectory is built from the token ids and log-probs the
    endpoint returns (nothing decoded and re-encoded)."""
    import openai

    client = openai.AsyncOpenAI(base_url=ctx.base_url, api_key="unused", max_retries=0)
    model = (await client.models.list()).data[0].id

    async def sample(j: int):
        s = ctx.sampling(j)
        out = await client.completions.create(
            model=model,
            prompt=problem.prompt_ids,
            max_tokens=s.max_new_tokens,
            temperature=s.temperature,
            seed=s.seed,
            logprobs=0,
            extra_body={"session_id": f"{problem.prompt}#{j}"},
        )
        choice = out.choices[0]
        b = TrajectoryBuilder(problem.prompt_ids)
        b.sampled(
            choice.token_ids,
            choice.logprobs.token_logprobs,
            out.weight_version,
            choice.finish_reason,
        )
        return b.build(response_text=choice.text)

    try:
        return list(await asyncio.gather(*(sample(j) for j in range(ctx.n))))
    finally:
        await client.close()


async def hangs(ctx, problem):
    await asyncio.sleep(3600)
