"""Multi-turn rollout functions in fully asynchronous training (`cluster.fully_async` with a
`rollout.function` other than single_turn: `tool_loop`, or a user's `async def fn(ctx,
problem)`): each drawn prompt's function runs as a task on the manager's loop, driven by the
producer (`async_producer.AsyncProducer`) like a single-turn group (`AgentGroups`).

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
from miles_like.rollouts import sample_routes
from miles_like.rollouts.functions import function_failed
from miles_like.rollouts.partial import EMPTY, OpenGroup, Partial
from miles_like.rollouts.replica_batcher import Generation
from miles_like.rollouts.trajectory import Trajectory
from miles_like.shares import replica_of


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
    """The `dispatch` of one agent group's RolloutContext (`ReplicaBatcher.generate`'s
    contract): each call is a wave of the producer's (`AgentGroups.wave`)."""

    def __init__(self, groups: AgentGroups, group: AgentGroup):
        self.groups = groups
        self.group = group

    async def generate(
        self, replica: int, prompt_ids: Sequence[int], params, later_turn: bool
    ) -> list[Generation]:
        g = self.group
        g.calls += 1
        call = g.calls
        parts: list[Partial] = [EMPTY] * params.n
        last = self.groups.flow.version
        while True:
            requests = self._requests(list(prompt_ids), params, parts, call)
            if not requests:
                break
            delivered = await self.groups.wave(replica, requests)
            for k, samples, version, versions in delivered:
                last = version
                for n, (s, j) in enumerate(zip(samples, requests[k][2])):
                    per_token = tuple(versions[n]) if n < len(versions) else ()
                    gen = Generation(
                        list(s.token_ids),
                        list(s.logprobs),
                        s.finish_reason,
                        version,
                        per_token,
                        s.routes,
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
                Generation(
                    list(s.token_ids), list(s.logprobs), s.finish_reason, version, mixed, s.routes
                )
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
                f"{self.groups.seed}/async-agent/{self.group.index}/{call}/{j}/{len(s.token_ids)}"
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


class AgentGroups:
    """The producer's open groups when the rollout function is multi-turn: each a task running
    the function (`ledger.agents`), its engine calls waves on its replica (`wave`), its
    trajectories buffered when it returns (`buffer.complete_agent`)."""

    def __init__(self, manager, ledger, flow, replicas, buffer, params):
        self.manager = manager
        self.seed = manager.recipe.seed
        self.per_step = manager.recipe.rollout.prompts_per_step
        self.ledger, self.flow, self.replicas, self.buffer = ledger, flow, replicas, buffer
        self.params = params  # the synchronous loop's SamplingParams of a data position

    def group(self, index: int, problem: Problem) -> AgentGroup:
        """Group `index`, on its replica: its place in its batch's contiguous shares."""
        replica = replica_of(index % self.per_step, self.per_step, len(self.replicas.engines))
        return AgentGroup(index, problem, replica)

    def start(self) -> None:
        """Start the groups not running yet (index order) and wake the calls waiting."""
        loop = asyncio.get_running_loop()
        for i in sorted(self.ledger.agents):
            group = self.ledger.agents[i]
            if group.task is None:
                group.task = loop.create_task(self._run(group))
        self.flow.wake.set()

    async def wave(self, replica: int, requests: list) -> list:
        """One agent call's requests (input ids, params, sample indices) as a wave on
        `replica`, once work is accepted and the replica is alive: what came back (aborted
        requests with the tokens they have); nothing when the window was closed or the replica
        died (the call sends its requests again). A non-death failure raises."""
        flow = self.flow
        while not flow.accepting or replica in self.replicas.dead:
            if flow.failure is not None:
                raise flow.failure
            flow.wake.clear()
            await flow.wake.wait()
        task = flow.track(asyncio.get_running_loop().create_task(self._wave(replica, requests)))
        got = await task
        if flow.failure is not None:
            raise flow.failure
        return got

    async def _wave(self, replica: int, requests: list) -> list:
        wave = self.replicas.next_wave_id()
        got = []
        try:
            prompts, params = [r[0] for r in requests], [r[1] for r in requests]
            failure = await self.replicas.stream_wave(replica, prompts, params, wave, got.append)
            self.flow.failure = self.flow.failure or failure
        finally:
            self.flow.changed.set()
        return got

    async def _run(self, group: AgentGroup) -> None:
        """The group's rollout function, then its trajectories to the buffer; a failure of the
        function (or of an engine) becomes the producer's `failure`, raised by `take`."""
        m = self.manager
        ctx = m.context_for(
            group.problem, self.params(group.index), AgentCalls(self, group), group.replica
        )
        try:
            out = await m.run_function(ctx, group.problem)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- raised to the controller by `take`
            if self.flow.failure is None:
                self.flow.failure = function_failed(m.spec, group.problem.prompt, e)
            self.flow.changed.set()
            return
        del self.ledger.agents[group.index]
        problem = OpenGroup(group.problem, (), group.rollouts)
        self.buffer.complete_agent(group.index, problem, out, ctx.tallies, group.oldest)


def trajectory_to_state(t: Trajectory) -> dict:
    """JSON-ready (floats round-trip exactly through json)."""
    row = {**dataclasses.asdict(t), "metrics": dict(t.metrics)}
    return row | {"routes": sample_routes.to_state(t.routes)}


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
        routes=sample_routes.from_state(row.get("routes")),
    )
