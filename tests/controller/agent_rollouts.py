"""Rollout functions for the tests (`rollout.function: agent_rollouts:NAME`).

`three_turns`: every sample talks three turns with a deterministic "tool" that answers how many
tokens the model's last turn had; the next turn's input is the previous tokens plus the chat
template's delta for the tool's message (nothing sampled is decoded and re-encoded). Each
trajectory and what went into it is recorded in `RECORDS` for the test to rebuild by hand.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from miles_like.trajectory import TrajectoryBuilder
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
    tok = ctx.tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")

    async def sample(j: int):
        b = TrajectoryBuilder(problem.prompt_ids)
        messages = [{"role": "user", "content": problem.prompt}]
        sampled, logprobs, appended = [], [], []
        mismatches = 0
        for turn in range(TURNS):
            g = await ctx.generate(b.token_ids, ctx.sampling(j, turn))
            b.sampled(g.token_ids, g.logprobs, g.weight_version, g.finish_reason, g.versions)
            if AFTER_FIRST_TURN:
                AFTER_FIRST_TURN.pop()()
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
    import dataclasses

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
