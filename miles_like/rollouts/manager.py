"""One step's rollout: draw prompts, run the rollout function (`rollout_context.py`) of every
prompt concurrently, score the trajectories, shape the rewards (DAPO's overlong penalty) and,
with dynamic sampling, drop groups whose rewards are all equal and draw more prompts until the
batch is full again.

The rollout functions run on the manager's own asyncio loop, in a thread, so a launched rollout
proceeds while the controller trains (off-policy). Their requests reach the engine replicas
through `dispatch.Dispatch`; prompt k's group lives on the replica of its contiguous share.
Every prompt gets its own sampling seed, drawn from (run seed, step, round), so a step's samples
do not depend on how prompts were split over engines, and a resumed run samples the same tokens.
For the same reason an engine that dies mid-rollout loses nothing: its lost call is sent again,
with the same seeds, to its replacement (`rollout/engine_restarts` counts them). Replacing an
engine is done on the controller's thread, in `finish`, where today's loop expects it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import ray
import torch

from miles_like.data import Problem, PromptSource
from miles_like.errors import RolloutFailed
from miles_like.recipe.build_configs import sampling_params
from miles_like.rollouts.context import RolloutContext
from miles_like.rollouts.oversampling import (
    OpenGroup,
    OverSampledRollout,
    from_state,
    launched,
    to_state,
)
from miles_like.rollouts.replica_batcher import Dispatch
from miles_like.rollouts.tools import ToolPool, load_tools
from miles_like.rollouts.trajectory import Trajectory
from miles_like.run.calls import ActorDied
from miles_like.scoring.rewards import compute_rewards
from miles_like.scoring.shaping import informative_groups, overlong_penalty


class Group(NamedTuple):
    problem: Problem
    trajectories: list[Trajectory]  # the n trajectories of this prompt
    scores: list[float]  # the reward function's scores (or the trajectories' own rewards)
    rewards: list[float]  # what the advantages see: scores + shaping


class Rollout(NamedTuple):
    groups: list[Group]
    metrics: dict[str, float]


class PendingRollout(NamedTuple):
    step: int
    problems: list[Problem]
    future: concurrent.futures.Future  # -> (trajectories per problem, tallies)
    inbox: queue.SimpleQueue  # engine replacements asked for; None when done
    dispatch: Dispatch
    started: float
    consumed_before: int  # the prompt source's position before this rollout drew its prompts
    carried_before: tuple = ()  # oversampling.OpenGroup carried into this rollout


def _split(n: int, parts: int) -> list[range]:
    size, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(range(start, end))
        start = end
    return out


# trajectory metrics summed over the step (counts); every other one is averaged
COUNT_METRICS = ("tool_errors", "retokenize_mismatch")


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
        self.source = source
        self.context_len, self.vocab_size = context_len, vocab_size
        self.restart_engine = restart_engine
        self.log = log
        self.front = front  # http_front.HttpFront with rollout.serve_http, else None
        self.spec = recipe.rollout.function
        self.rollout_fn = rollout_fn  # what the spec names (rollout_functions.py)
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
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="rollouts", daemon=True).start()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self.tool_pool is not None:
            self.tool_pool.close()

    # ------------------------------------------------------------------------------ generation
    def _params(self, step: int, round_: int, k: int) -> list:
        rng = random.Random(f"{self.recipe.seed}/{step}/{round_}")
        return [sampling_params(self.recipe, seed=rng.getrandbits(62)) for _ in range(k)]

    def launch(
        self, step: int, problems: list[Problem] | None = None, round_: int = 0
    ) -> PendingRollout:
        """Start the rollout (non-blocking) of `problems`, default the next batch of prompts."""
        if self.streaming:
            return self._launch_streaming(step)
        consumed_before = self.source.consumed
        if problems is None:
            problems = self.source.next_batch(self.recipe.rollout.prompts_per_step)
        params = self._params(step, round_, len(problems))
        # empty shares (fewer prompts than engines) are the last ones: share i is engine i's
        home = {
            k: i for i, share in enumerate(_split(len(problems), len(self.engines))) for k in share
        }
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        dispatch = Dispatch(
            self.engines, self.recipe.cluster.call_timeout_s, replace=self._replacer(inbox)
        )
        future = asyncio.run_coroutine_threadsafe(
            self._run(problems, params, home, dispatch), self._loop
        )
        future.add_done_callback(lambda _: inbox.put(None))
        return PendingRollout(
            step, problems, future, inbox, dispatch, time.perf_counter(), consumed_before
        )

    def _launch_streaming(self, step: int) -> PendingRollout:
        """The carried groups, then fresh prompts up to the launched count (`oversampling.py`)."""
        r = self.recipe.rollout
        consumed_before = self.source.consumed
        carried, self.carry = self.carry, []
        fresh = self.source.next_batch(launched(r.prompts_per_step, r.over_sampling) - len(carried))
        groups = carried + [OpenGroup(p, ()) for p in fresh]
        params = self._params(step, 0, len(groups))
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        dispatch = Dispatch(
            self.engines, self.recipe.cluster.call_timeout_s, replace=self._replacer(inbox)
        )
        future = asyncio.run_coroutine_threadsafe(
            OverSampledRollout(self, list(groups), params, dispatch).run(), self._loop
        )
        future.add_done_callback(lambda _: inbox.put(None))
        return PendingRollout(
            step,
            [g.problem for g in groups],
            future,
            inbox,
            dispatch,
            time.perf_counter(),
            consumed_before,
            tuple(carried),
        )

    def carry_state(self, pending: PendingRollout | None) -> list[dict]:
        """The carried groups before `pending` was launched (a resumed run launches it again),
        for the checkpoint's state.json."""
        return to_state(pending.carried_before if pending is not None else self.carry)

    def restore_carry(self, rows: list[dict]) -> None:
        self.carry = from_state(rows)

    def _replacer(self, inbox: queue.SimpleQueue):
        async def replace(i: int, died: ActorDied, requests: int) -> None:
            if self.restart_engine is None:
                raise died
            done = asyncio.get_running_loop().create_future()
            inbox.put((i, died, requests, done))
            await done

        return replace

    async def _run(
        self, problems: list[Problem], params: list, home: dict[int, int], dispatch: Dispatch
    ) -> tuple[list[list[Trajectory]], Counter]:
        r = self.recipe.rollout
        tallies: Counter = Counter()

        async def group(k: int) -> list[Trajectory]:
            ctx = RolloutContext(
                problem=problems[k],
                params=params[k],
                dispatch=dispatch,
                replica=home[k],
                tokenizer=self.tokenizer.tok,
                context_len=self.context_len,
                vocab_size=self.vocab_size,
                reward_fn=self.reward_fn,
                reward_timeout_s=self.recipe.reward.timeout_s,
                reward_workers=self.recipe.reward.max_workers,
                tools=r.tools,
                max_turns=r.max_turns,
                base_url=self.front.base_url if self.front else None,
                tool_pool=self.tool_pool,
                settings=r,
            )
            try:
                out = await self.rollout_fn(ctx, problems[k])
                self._check_group(out, ctx.n)
            except Exception as e:
                if dispatch.failure is not None:  # an engine's failure, not the function's
                    raise dispatch.failure from None
                raise RolloutFailed(
                    f"{self._failure(problems[k])}: {_where(e)}{type(e).__name__}: {e}"
                ) from e
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
        if dispatch.failure is not None:
            raise dispatch.failure
        return list(groups), tallies + dispatch.tallies

    def _failure(self, problem: Problem) -> str:
        return f"rollout.function={self.spec!r} failed on the prompt {problem.prompt!r}"

    def _check_group(self, out, n: int) -> None:
        if not isinstance(out, list) or len(out) != n:
            raise ValueError(
                f"returned {type(out).__name__} of "
                f"{len(out) if hasattr(out, '__len__') else '?'} items; return a "
                f"list of rollout.n={n} Trajectory"
            )
        for j, t in enumerate(out):
            if not isinstance(t, Trajectory):
                raise TypeError(f"item {j} is a {type(t).__name__}, not a Trajectory")
            try:
                t.check()
                if len(t.token_ids) > self.context_len:
                    raise ValueError(
                        f"{len(t.token_ids)} tokens exceed the context of "
                        f"{self.context_len} (check ctx.room before a turn)"
                    )
            except (TypeError, ValueError) as e:
                raise type(e)(f"trajectory {j}: {e}") from None

    def _wait(self, pending: PendingRollout) -> tuple[list[list[Trajectory]], Counter]:
        """Wait for `pending`, replacing the engines it reports dead on this thread. A rollout
        with no engine answer (nor engine replaced) for `cluster.call_timeout_s` is hung."""
        timeout = self.recipe.cluster.call_timeout_s
        while True:
            try:
                msg = pending.inbox.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() - pending.dispatch.last_progress > timeout:
                    pending.future.cancel()
                    raise RolloutFailed(
                        f"rollout.function={self.spec!r}: no progress within {timeout:g} s "
                        "(cluster.call_timeout_s); a rollout function is hung, or the "
                        "timeout is too small"
                    ) from None
                continue
            if msg is None:
                return pending.future.result()
            i, died, requests, done = msg
            self.log(f"{died}; restarting it and sending its {requests} requests again")
            try:
                engine = self.restart_engine(i, died)
                if self.front is not None:
                    ray.get(engine.open.remote(), timeout=timeout)
            except BaseException as e:
                self._loop.call_soon_threadsafe(_settle, done, e)
                raise
            pending.dispatch.last_progress = time.monotonic()
            self._loop.call_soon_threadsafe(_settle, done, None)

    def _collect(self, pending: PendingRollout) -> tuple[list[Group], Counter]:
        """Wait for `pending` and score it: its groups, and its tallies (reward errors / NaN,
        generated tokens, prefill tokens computed and taken from the prefix cache, engine
        restarts)."""
        trajectories, tallies = self._wait(pending)
        groups, scored = self._score(pending.problems, trajectories)
        tallies.update(scored)
        return groups, tallies

    # --------------------------------------------------------------------------------- scoring
    def _score(
        self, problems: list[Problem], trajectories: list[list[Trajectory]]
    ) -> tuple[list[Group], dict]:
        """Groups with scores and shaped rewards, and the reward function's failure counts. A
        trajectory's own reward stands; the others are scored on their `response_text`."""
        r = self.recipe
        unscored = [
            (p, t) for p, group in zip(problems, trajectories) for t in group if t.reward is None
        ]
        result = compute_rewards(
            self.reward_fn,
            [p.prompt for p, _ in unscored],
            [t.response_text for _, t in unscored],
            [p.answer for p, _ in unscored],
            max_workers=r.reward.max_workers,
            timeout_s=r.reward.timeout_s,
        )
        computed = iter(result.scores)
        flat = [
            t.reward if t.reward is not None else next(computed)
            for group in trajectories
            for t in group
        ]
        lengths = torch.tensor([t.sampled_tokens for g in trajectories for t in g])
        penalty = overlong_penalty(
            lengths,
            r.rollout.max_new_tokens,
            r.algorithm.overlong_buffer,
            r.algorithm.overlong_penalty,
        )
        groups, k, n = [], 0, r.rollout.n
        for p, group in zip(problems, trajectories):
            scores = flat[k : k + n]
            rewards = [s + float(penalty[k + j]) for j, s in enumerate(scores)]
            groups.append(Group(p, group, scores, rewards))
            k += n
        return groups, {
            "reward_errors": result.num_errors,
            "reward_nan": result.num_nan,
            "reward_timeouts": result.num_timeouts,
        }

    # ---------------------------------------------------------------------------------- finish
    def finish(self, pending: PendingRollout) -> Rollout:
        """Wait for `pending`, score it, and (dynamic sampling) refill dropped groups."""
        r = self.recipe
        if self.streaming:
            outcome = self._wait(pending)
            self.carry = outcome.carried
            batch = outcome.batch
            return self._rollout(pending, batch, batch, outcome.tallies, 1, outcome.metrics)
        generated, tallies = self._collect(pending)
        kept, rounds = generated, 1
        if r.algorithm.dynamic_sampling:
            kept = self._informative(generated)
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
                informative = self._informative(extra)
                tallies["dropped_groups"] += len(extra) - len(informative)
                generated, kept = generated + extra, kept + informative
                rounds += 1
            # nothing informative after every round: train on what there is (zero advantages)
            kept = kept[: r.rollout.prompts_per_step] or generated[: r.rollout.prompts_per_step]
        return self._rollout(pending, generated, kept, tallies, rounds, {})

    def _rollout(
        self, pending: PendingRollout, generated, kept, tallies: Counter, rounds: int, extra: dict
    ) -> Rollout:
        r = self.recipe
        seconds = time.perf_counter() - pending.started
        metrics = self._metrics(generated)
        hits, computed = tallies["prefix_cache_hit_tokens"], tallies["prefill_tokens_computed"]
        later_hits = tallies["prefix_cache_hit_tokens_turn2plus"]
        later_computed = tallies["prefill_tokens_computed_turn2plus"]
        metrics.update(
            reward_errors=tallies["reward_errors"],
            reward_nan=tallies["reward_nan"],
            reward_timeouts=tallies["reward_timeouts"],
            generated_tokens=tallies["generated_tokens"],
            tokens_per_s=tallies["generated_tokens"] / max(seconds, 1e-9),
            prefix_cache_hit_rate=hits / max(hits + computed, 1),
            prefix_cache_hit_rate_turn2plus=later_hits / max(later_hits + later_computed, 1),
            samples=sum(len(g.trajectories) for g in kept),
            engine_restarts=tallies["engine_restarts"],
        )
        if r.algorithm.dynamic_sampling:
            metrics.update(
                dynamic_rounds=rounds,
                dynamic_dropped_groups=tallies["dropped_groups"],
                dynamic_kept_groups=len(kept),
            )
        metrics.update(extra)
        return Rollout(kept, metrics)

    def async_rollout(self, taken) -> dict[str, float]:
        """The rollout/ metrics of a fully asynchronous batch (`async_rollouts.Taken`), those of
        `_rollout`: the groups' own over the batch, the engines' counters over the window
        since the previous batch (what the engines did meanwhile, for any group)."""
        metrics = self._metrics(taken.groups)
        engine, tallies = taken.engine, taken.tallies
        hits, computed = engine["prefix_cache_hit_tokens"], engine["prefill_tokens_computed"]
        metrics.update(
            reward_errors=tallies["reward_errors"],
            reward_nan=tallies["reward_nan"],
            reward_timeouts=tallies["reward_timeouts"],
            generated_tokens=engine["generated_tokens"],
            tokens_per_s=engine["generated_tokens"] / max(taken.seconds, 1e-9),
            prefix_cache_hit_rate=hits / max(hits + computed, 1),
            prefix_cache_hit_rate_turn2plus=0.0,
            samples=sum(len(g.trajectories) for g in taken.groups),
            engine_restarts=0,
        )
        if self.recipe.rollout.partial == "in_place":  # K/V not computed again after an update
            metrics["in_place_reused_tokens"] = float(
                engine["parked_reused_tokens"] + engine["in_place_kept_tokens"]
            )
        return metrics

    @staticmethod
    def _informative(groups: list[Group]) -> list[Group]:
        if not groups:
            return []
        mask = informative_groups(torch.tensor([g.rewards for g in groups]))
        return [g for g, keep in zip(groups, mask.tolist()) if keep]

    @staticmethod
    def _metrics(groups: list[Group]) -> dict:
        """Reward, length and turn metrics over every generated group of the step (kept or
        dropped). Trajectory metrics: COUNT_METRICS are summed, the others averaged (`_mean`);
        turns, tool calls and the counts are always there (a single turn: 1, 0, 0)."""
        scores = torch.tensor([g.scores for g in groups], dtype=torch.float64)
        rewards = torch.tensor([g.rewards for g in groups], dtype=torch.float64)
        trajectories = [t for g in groups for t in g.trajectories]
        lengths = torch.tensor(
            [[t.response_len for t in g.trajectories] for g in groups], dtype=torch.float64
        )
        truncated = sum(t.finish_reason == "length" for t in trajectories)
        out = {
            "reward_mean": float(scores.mean()),
            "reward_std": float(scores.std(unbiased=False)),
            "reward_group_std_mean": float(scores.std(dim=1, unbiased=False).mean()),
            "shaped_reward_mean": float(rewards.mean()),
            "response_len_mean": float(lengths.mean()),
            "response_len_max": float(lengths.max()),
            "truncated_frac": truncated / lengths.numel(),
            "loss_mask_frac": sum(t.sampled_tokens for t in trajectories) / float(lengths.sum()),
            "turns_mean": 1.0,
            "tool_calls_mean": 0.0,
            **{k: 0.0 for k in COUNT_METRICS},
        }
        for key in sorted({k for t in trajectories for k in t.metrics}):
            values = [float(t.metrics.get(key, 0.0)) for t in trajectories]
            if key.startswith(COUNT_METRICS):
                out[key] = sum(values)
            else:
                out[f"{key}_mean"] = sum(values) / len(values)
        return out


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if not future.done():
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)


def _where(error: BaseException) -> str:
    """'file.py:12: ' for the innermost frame that raised `error` (user code, usually)."""
    frames = traceback.extract_tb(error.__traceback__)
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].lineno}: " if frames else ""
