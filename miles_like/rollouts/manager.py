"""One step's rollout: draw prompts, run the rollout function (`context.py`) of every prompt
concurrently, score the trajectories, shape the rewards (DAPO's overlong penalty) and, with
dynamic sampling, drop groups whose rewards are all equal and draw more prompts until the batch
is full again.

The rollout functions run on the manager's own asyncio loop, in a thread, so a launched rollout
proceeds while the controller trains (off-policy). Their requests reach the engine replicas
through a `ReplicaBatcher`; prompt k's group lives on the replica of its contiguous share
(`shares.py`). Every prompt gets its own sampling seed, drawn from (run seed, step, round), so a
step's samples do not depend on how prompts were split over engines, and a resumed run samples
the same tokens. For the same reason an engine that dies mid-rollout loses nothing: its lost
call is sent again, with the same seeds, to its replacement (`rollout/engine_restarts` counts
them). Replacing an engine is done on the controller's thread, in `finish`, where the loop
expects it (`engine_deaths.RestartRequests`).

Over-sampled and streaming-scored rollouts (`oversampling.py`) launch through the same calls;
the fully asynchronous producer (`async_producer/`) runs on the same loop and builds its
groups' contexts here (`context_for`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import random
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import ray

from miles_like.data import Problem, PromptSource
from miles_like.errors import RolloutFailed
from miles_like.recipe import build_configs
from miles_like.rollouts.context import EngineRequests, RolloutContext
from miles_like.rollouts.engine_deaths import RestartRequests
from miles_like.rollouts.functions import check_group, function_failed
from miles_like.rollouts.group_scoring import Group, GroupScorer, informative
from miles_like.rollouts.oversampling import OverSampledRollout, launched
from miles_like.rollouts.partial import OpenGroup, from_state, to_state
from miles_like.rollouts.replica_batcher import ReplicaBatcher
from miles_like.rollouts.rollout_metrics import async_batch_metrics, step_metrics
from miles_like.rollouts.tools import ToolPool, load_tools
from miles_like.rollouts.trajectory import Trajectory
from miles_like.run.calls import ActorDied
from miles_like.shares import near_equal_shares

__all__ = ["Group", "PendingRollout", "Rollout", "RolloutManager"]


class Rollout(NamedTuple):
    groups: list[Group]
    metrics: dict[str, float]


class PendingRollout(NamedTuple):
    step: int
    problems: list[Problem]
    future: concurrent.futures.Future  # -> (trajectories per problem, tallies)
    restarts: RestartRequests  # engine replacements asked for, served by `finish`
    batcher: ReplicaBatcher
    started: float
    consumed_before: int  # the prompt source's position before this rollout drew its prompts
    carried_before: tuple = ()  # partial.OpenGroup carried into this rollout


class RolloutManager:
    """`engines` is used as given (not copied): the owner replaces a dead engine in it.
    `restart_engine(i, died)` replaces engine i and returns the new one (or raises, its restart
    budget spent); without it an engine's death raises `calls.ActorDied`. `context_len`
    bounds a trajectory (prompt + every turn).
    `tokenizer` is the run's `HFTokenizer`; rollout functions get its transformers `.tok`."""

    def __init__(
        self,
        recipe,
        engines: list,
        tokenizer,
        reward_fn,
        source: PromptSource,
        *,
        rollout_fn,
        context_len: int,
        vocab_size: int,
        restart_engine: Callable[[int, ActorDied], object] | None = None,
        log=print,
        front=None,
    ):
        self.recipe = recipe
        self.engines = engines
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.scorer = GroupScorer(recipe, reward_fn, tokenizer.tok)
        self.source = source
        self.context_len, self.vocab_size = context_len, vocab_size
        self.restart_engine = restart_engine
        self.log = log
        self.front = front  # http_front.HttpFront with rollout.serve_http, else None
        self.spec = recipe.rollout.function
        self.rollout_fn = rollout_fn  # what the spec names (functions.py)
        r = recipe.rollout
        # one pool for the run: its worker processes outlive steps (tools.py)
        self.tool_pool = (
            ToolPool(
                load_tools(r.tools),
                workers=r.tool_workers,
                timeout_s=r.tool_timeout_s,
                max_output_chars=r.tool_output_max_chars,
            )
            if r.tools
            else None
        )
        # over-sampling / streaming scoring (single-turn only): `oversampling.py`
        self.streaming = r.over_sampling > 1 or r.stream_scoring
        self.carry: list[OpenGroup] = []  # groups the last rollout left unfinished (retract)
        # the rollouts' loop, in its own thread (the asynchronous producer runs on it too)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollouts", daemon=True).start()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        if self.tool_pool is not None:
            self.tool_pool.close()

    # ------------------------------------------------------------------------------ generation
    def sampling_params(self, step: int, round_: int, k: int) -> list:
        """The SamplingParams of the `k` prompts of (step, dynamic-sampling round), each with
        its own seed drawn from (run seed, step, round)."""
        rng = random.Random(f"{self.recipe.seed}/{step}/{round_}")
        return [
            build_configs.sampling_params(self.recipe, seed=rng.getrandbits(62)) for _ in range(k)
        ]

    def context_for(
        self, problem: Problem, params, dispatch: EngineRequests, replica: int
    ) -> RolloutContext:
        """The rollout function's context for `problem`'s group on `replica`: its sampling
        parameters (n, base seed), where its requests go, and the run's tokenizer, tools,
        budgets and reward."""
        r = self.recipe
        return RolloutContext(
            problem=problem,
            params=params,
            dispatch=dispatch,
            replica=replica,
            tokenizer=self.tokenizer.tok,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            reward_fn=self.reward_fn,
            reward_timeout_s=r.reward.timeout_s,
            reward_workers=r.reward.max_workers,
            tools=r.rollout.tools,
            max_turns=r.rollout.max_turns,
            # (never with the asynchronous producer's agent groups: the recipe refuses
            # rollout.serve_http there, HTTP requests would bypass its per-call versions)
            base_url=self.front.base_url if self.front else None,
            tool_pool=self.tool_pool,
            settings=r.rollout,
        )

    async def run_function(self, ctx: RolloutContext, problem: Problem) -> list[Trajectory]:
        """The rollout function's group for `problem`, checked (`functions.check_group`)."""
        out = await self.rollout_fn(ctx, problem)
        check_group(out, ctx.n, self.context_len)
        return out

    def launch(
        self, step: int, problems: list[Problem] | None = None, round_: int = 0
    ) -> PendingRollout:
        """Start the rollout (non-blocking) of `problems`, default the next batch of prompts."""
        if self.streaming:
            return self._launch_streaming(step)
        consumed_before = self.source.consumed
        if problems is None:
            problems = self.source.next_batch(self.recipe.rollout.prompts_per_step)
        params = self.sampling_params(step, round_, len(problems))
        # empty shares (fewer prompts than engines) are the last ones: share i is engine i's
        # (prefill-decode: decode replica i's, engines[prefill_replicas + i])
        first = self.recipe.rollout.prefill_replicas
        home = {
            k: first + i
            for i, share in enumerate(near_equal_shares(len(problems), len(self.engines) - first))
            for k in share
        }
        return self._start(
            step, problems, consumed_before, (), lambda b: self._run(problems, params, home, b)
        )

    def _launch_streaming(self, step: int) -> PendingRollout:
        """The carried groups, then fresh prompts up to the launched count (`oversampling.py`)."""
        r = self.recipe.rollout
        consumed_before = self.source.consumed
        carried, self.carry = self.carry, []
        fresh = self.source.next_batch(launched(r.prompts_per_step, r.over_sampling) - len(carried))
        groups = carried + [OpenGroup(p, ()) for p in fresh]
        params = self.sampling_params(step, 0, len(groups))
        return self._start(
            step,
            [g.problem for g in groups],
            consumed_before,
            tuple(carried),
            lambda b: OverSampledRollout(
                self.recipe, self.engines, self.scorer, list(groups), params, b
            ).run(),
        )

    def _start(self, step, problems, consumed_before, carried, rollout) -> PendingRollout:
        """`rollout(batcher)` on the loop, its engine replacements served by `finish`."""
        restarts = RestartRequests(self.loop)
        batcher = ReplicaBatcher(
            self.engines,
            self.recipe.cluster.call_timeout_s,
            restarts if self.restart_engine is not None else None,
            self.recipe.rollout.prefill_replicas,
            self.recipe.rollout.pd_local_prefill_tokens,
        )
        future = asyncio.run_coroutine_threadsafe(rollout(batcher), self.loop)
        future.add_done_callback(lambda _: restarts.close())
        return PendingRollout(
            step,
            problems,
            future,
            restarts,
            batcher,
            time.perf_counter(),
            consumed_before,
            carried,
        )

    def carry_state(self, pending: PendingRollout | None) -> list[dict]:
        """The carried groups before `pending` was launched (a resumed run launches it again),
        for the checkpoint's state.json."""
        return to_state(pending.carried_before if pending is not None else self.carry)

    def restore_carry(self, rows: list[dict]) -> None:
        self.carry = from_state(rows)

    async def _run(
        self, problems: list[Problem], params: list, home: dict[int, int], batcher: ReplicaBatcher
    ) -> tuple[list[list[Trajectory]], Counter]:
        tallies: Counter = Counter()

        async def group(k: int) -> list[Trajectory]:
            ctx = self.context_for(problems[k], params[k], batcher, home[k])
            try:
                out = await self.run_function(ctx, problems[k])
            except Exception as e:
                if batcher.failure is not None:  # an engine's failure, not the function's
                    raise batcher.failure from None
                raise function_failed(self.spec, problems[k].prompt, e) from e
            tallies.update(ctx.tallies)
            return out

        if self.front is not None:  # agent code may call the endpoints: open the window
            await asyncio.gather(
                *(asyncio.wrap_future(e.open.remote().future()) for e in self.engines)
            )
        # created in prompt order: every group's first request is queued before any is sent
        tasks = [asyncio.ensure_future(group(k)) for k in range(len(problems))]
        try:
            groups = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            raise
        if batcher.failure is not None:
            raise batcher.failure
        if batcher.pd is not None:  # counted in this rollout's engine_restarts
            await batcher.pd.replace_dead_prefill_replicas()
        return list(groups), tallies + batcher.tallies

    def _wait(self, pending: PendingRollout):
        """`pending`'s result, replacing the engines it reports dead on this thread. A rollout
        with no engine answer (nor engine replaced) for `cluster.call_timeout_s` is hung."""
        timeout = self.recipe.cluster.call_timeout_s

        def restart(i: int, died: ActorDied, requests: int) -> None:
            self.log(f"{died}; restarting it and sending its {requests} requests again")
            engine = self.restart_engine(i, died)
            if self.front is not None:
                ray.get(engine.open.remote(), timeout=timeout)
            pending.batcher.last_progress = time.monotonic()

        def hung() -> None:
            if time.monotonic() - pending.batcher.last_progress > timeout:
                pending.future.cancel()
                raise RolloutFailed(
                    f"rollout.function={self.spec!r}: no progress within {timeout:g} s "
                    "(cluster.call_timeout_s); a rollout function is hung, or the "
                    "timeout is too small"
                ) from None

        pending.restarts.serve(restart, poll_s=1.0, idle=hung)
        return pending.future.result()

    def _collect(self, pending: PendingRollout) -> tuple[list[Group], Counter]:
        """Wait for `pending` and score it: its groups, and its tallies (reward errors / NaN,
        generated tokens, prefill tokens computed and taken from the prefix cache, engine
        restarts)."""
        trajectories, tallies = self._wait(pending)
        groups, scored = self.scorer.groups(pending.problems, trajectories)
        tallies.update(scored)
        return groups, tallies

    # ---------------------------------------------------------------------------------- finish
    def finish(self, pending: PendingRollout) -> Rollout:
        """Wait for `pending`, score it, and (dynamic sampling) refill dropped groups."""
        r = self.recipe
        if self.streaming:
            outcome = self._wait(pending)
            self.carry = outcome.carried
            batch, seconds = outcome.batch, time.perf_counter() - pending.started
            rounds = 1 if r.algorithm.dynamic_sampling else None  # (the recipe refuses both)
            metrics = step_metrics(batch, batch, outcome.tallies, seconds, rounds)
            return Rollout(batch, {**metrics, **outcome.metrics})
        generated, tallies = self._collect(pending)
        kept, rounds = generated, 1
        if r.algorithm.dynamic_sampling:
            kept = informative(generated)
            tallies["dropped_groups"] += len(generated) - len(kept)
            while (
                len(kept) < r.rollout.prompts_per_step
                and rounds <= r.algorithm.dynamic_sampling_max_rounds
            ):
                more = self.launch(
                    pending.step,
                    self.source.next_batch(r.rollout.prompts_per_step - len(kept)),
                    round_=rounds,
                )
                extra, t = self._collect(more)
                tallies.update(t)
                more_kept = informative(extra)
                tallies["dropped_groups"] += len(extra) - len(more_kept)
                generated, kept = generated + extra, kept + more_kept
                rounds += 1
            # nothing informative after every round: train on what there is (zero advantages)
            kept = kept[: r.rollout.prompts_per_step] or generated[: r.rollout.prompts_per_step]
        seconds = time.perf_counter() - pending.started
        dynamic_rounds = rounds if r.algorithm.dynamic_sampling else None
        return Rollout(kept, step_metrics(generated, kept, tallies, seconds, dynamic_rounds))

    def async_rollout(self, taken) -> dict[str, float]:
        """The rollout/ metrics of a fully asynchronous batch (`async_producer.AsyncBatch`),
        the keys of a synchronous step's (`rollout_metrics.async_batch_metrics`)."""
        in_place = self.recipe.rollout.partial == "in_place"
        return async_batch_metrics(
            taken.groups, taken.tallies, taken.engine, taken.seconds, in_place
        )
