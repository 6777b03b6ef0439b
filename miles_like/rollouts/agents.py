"""Multi-turn rollout functions in fully asynchronous training (`cluster.fully_async` with a
`rollout.function` other than single_turn: `tool_loop`, or a user's `async def fn(ctx,
problem)`): each drawn prompt's function runs as a task on the manager's loop, driven by the
producer (`async_rollouts.AsyncProducer`) like a single-turn group.

* **Engine calls** (`ctx.generate`, `ctx.generate_group`) go through `AgentCalls`, the group's
  `dispatch`: each call is one `EngineWorker.generate_wave` on the group's replica (its
  contiguous share of the data position in its batch, as the synchronous loop places it). A
  call waits while the producer does not accept work (a weight update, a dead replica being
  replaced) and is then sent; the engine batches concurrent calls in its step loop.
* **A weight update** aborts the calls running (retract): each returns the tokens it has and
  the call continues after the update from them, each unfinished sample as a request of its
  input + tokens so far (prefilled again under the new weights, a seed of its own, the
  remaining `max_new_tokens`), so the function sees one `Generation` per sample: its tokens,
  the log-prob and version that sampled each (`Generation.versions` when they differ), which
  `TrajectoryBuilder.sampled(..., versions=)` records. A call whose replica dies continues the
  same way on the replacement. Tools keep running in their worker processes through an update.
* **Staleness** of an agent group: the trainer's version minus the oldest version of any token
  an engine call of the group returned (the producer's own record, whatever the function puts
  in its trajectories). An open group too old at an update is cancelled and dropped, as an
  open single-turn group is; with `rollout.partial: abort` a group that had tokens is aborted.
* **Checkpoints**: a finished group in the buffer is saved with its trajectories and scored
  again at the resume; a group still running at the checkpoint is saved as its prompt and
  restarts from it at the resume (its first seeds: the tokens, tool results and versions it
  had are not part of the checkpoint). Its index stays held throughout, so the accounting
  (trained + dropped + filtered + held = every drawn index, once) holds across a kill -9.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from collections.abc import Sequence

from miles_like.data import Problem
from miles_like.errors import RolloutFailed
from miles_like.rollouts.context import RolloutContext
from miles_like.rollouts.oversampling import EMPTY, Partial
from miles_like.rollouts.replica_batcher import Generation
from miles_like.rollouts.trajectory import Trajectory


@dataclasses.dataclass
class AgentGroup:
    """An open agent group (owned by the manager's loop)."""

    index: int
    problem: Problem
    replica: int
    task: asyncio.Task | None = None  # None until started (a restored group waits for it)
    oldest: int | None = None  # the oldest version of the tokens its calls returned
    rollouts: int = 0  # weight updates it was open across with tokens
    calls: int = 0  # engine calls made (names the seeds of continuations)


class AgentCalls:
    """The `dispatch` of one agent group's RolloutContext (`Dispatch.generate`'s contract)."""

    def __init__(self, producer, group: AgentGroup):
        self.p = producer
        self.group = group

    async def generate(
        self, replica: int, prompt_ids: Sequence[int], params, later_turn: bool
    ) -> list[Generation]:
        g = self.group
        g.calls += 1
        call = g.calls
        parts: list[Partial] = [EMPTY] * params.n
        last = self.p.version
        while True:
            requests = self._requests(list(prompt_ids), params, parts, call)
            if not requests:
                break
            delivered = await self.p.agent_wave(replica, requests)
            for k, samples, version, versions in delivered:
                last = version
                for n, (s, j) in enumerate(zip(samples, requests[k][2])):
                    per_token = tuple(versions[n]) if n < len(versions) else ()
                    gen = Generation(
                        list(s.token_ids), list(s.logprobs), s.finish_reason, version, per_token
                    )
                    parts[j] = parts[j].extended(gen)
                    if parts[j].versions:
                        oldest = min(parts[j].versions)
                        g.oldest = oldest if g.oldest is None else min(g.oldest, oldest)
        out = []
        for s in parts:
            version = s.versions[-1] if s.versions else last
            mixed = s.versions if set(s.versions) - {version} else ()
            out.append(
                Generation(list(s.token_ids), list(s.logprobs), s.finish_reason, version, mixed)
            )
        return out

    def _requests(self, prompt: list[int], params, parts: list[Partial], call: int) -> list:
        """(input ids, params, sample indices): the call's one request of n samples first; after
        an abort, one per unfinished sample from its tokens (its own seed)."""
        if all(s == EMPTY for s in parts):  # not sent yet, or nothing came back
            return [(prompt, params, list(range(params.n)))]
        out = []
        for j, s in enumerate(parts):
            if s.done:
                continue
            rng = random.Random(
                f"{self.p.recipe.seed}/async-agent/{self.group.index}/{call}/{j}/{len(s.token_ids)}"
            )
            p = dataclasses.replace(
                params,
                n=1,
                seed=rng.getrandbits(62),
                max_new_tokens=params.max_new_tokens - len(s.token_ids),
            )
            if p.max_new_tokens < 1:  # the budget was spent exactly at the abort
                parts[j] = s._replace(finish_reason="length")
                continue
            out.append((prompt + list(s.token_ids), p, [j]))
        return out


def context(producer, group: AgentGroup) -> RolloutContext:
    """The group's RolloutContext: the synchronous loop's, with `AgentCalls` as its dispatch."""
    m, r = producer.m, producer.recipe.rollout
    return RolloutContext(
        problem=group.problem,
        params=producer._first_params(group.index),
        dispatch=AgentCalls(producer, group),
        replica=group.replica,
        tokenizer=m.tokenizer.tok,
        context_len=m.context_len,
        vocab_size=m.vocab_size,
        reward_fn=m.reward_fn,
        reward_timeout_s=producer.recipe.reward.timeout_s,
        reward_workers=producer.recipe.reward.max_workers,
        tools=r.tools,
        max_turns=r.max_turns,
        base_url=None,
        tool_pool=m.tool_pool,
        settings=r,
    )


async def run_group(producer, group: AgentGroup) -> None:
    """The group's rollout function, then its trajectories to the producer's buffer; a failure
    of the function (or of an engine) becomes the producer's `failure`, raised by `take`."""
    from miles_like.rollouts.manager import _where

    m = producer.m
    ctx = context(producer, group)
    try:
        out = await m.rollout_fn(ctx, group.problem)
        m._check_group(out, ctx.n)
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001 -- raised to the controller by `take`
        if producer.failure is None:
            producer.failure = RolloutFailed(
                f"{m._failure(group.problem)}: {_where(e)}{type(e).__name__}: {e}"
            )
        producer._changed.set()
        return
    producer.agent_finished(group, out, ctx.tallies)


def score_trajectories(manager, problem: Problem, trajectories: list[Trajectory], tallies):
    """(rollout_manager.Group, failure counts) of a finished agent group, scored as the
    synchronous loop scores one (a trajectory's own reward stands, the others are scored on
    their text; DAPO's overlong penalty), with its function's own `ctx.reward` counts."""
    (group,), counts = manager._score([problem], [trajectories])
    for k, v in tallies.items():
        counts[k] = counts.get(k, 0) + v
    return group, counts


def trajectory_to_state(t: Trajectory) -> dict:
    """JSON-ready (floats round-trip exactly through json)."""
    return {**dataclasses.asdict(t), "metrics": dict(t.metrics)}


def trajectory_from_state(row: dict) -> Trajectory:
    return Trajectory(
        tuple(row["token_ids"]),
        row["prompt_len"],
        tuple(row["loss_mask"]),
        tuple(float(x) for x in row["logprobs"]),
        tuple(row["weight_versions"]),
        reward=row["reward"],
        response_text=row["response_text"],
        finish_reason=row["finish_reason"],
        metrics=dict(row["metrics"]),
    )
