"""The rollout-function API against real engine replicas (Ray actors on CPU, float64): a
multi-turn function's trajectories rebuilt from a hand-built conversation, the seeds of
`ctx.sampling`, the turn >= 2 prefix-cache counter, and what a malformed function gets
(one line naming the function and the prompt). The full loop with a multi-turn function is in
`test_rollout_functions_e2e.py`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import agent_rollouts
import pytest
import ray

from miles_like.data import PromptSource
from miles_like.errors import RolloutFailed
from miles_like.models.store import base_model_dir
from miles_like.models.tokenizer import load_tokenizer
from miles_like.recipe import RecipeError, load_recipe
from miles_like.recipe.build_configs import engine_config
from miles_like.rollouts.functions import resolve_rollout_function
from miles_like.rollouts.manager import RolloutManager
from miles_like.rollouts.trajectory import NOT_SAMPLED, Trajectory, TrajectoryBuilder
from miles_like.run.engine_worker import EngineWorker
from miles_like.run.http_front import HttpFront
from miles_like.scoring.rewards import resolve_reward
from rollout import chat

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny_arith_grpo.yaml")
pytestmark = pytest.mark.slow


def recipe_with(function: str, *more: str):
    return load_recipe(
        RECIPE,
        [
            "rollout.prompts_per_step=3",
            "rollout.n=2",
            "seed=4",
            "rollout.max_new_tokens=5",
            "rollout.kv_cache_tokens=2048",
            "trainer.updates_per_rollout=1",
            f"rollout.function={function}",
            *more,
        ],
    )


@pytest.fixture(scope="module")
def engines(ray_local, tmp_path_factory, monkeypatch_module):
    """Two engine replicas of the built-in model (random weights), float64."""
    recipe = recipe_with("single_turn")
    model = base_model_dir(recipe.model, recipe.seed)
    cfg = engine_config(recipe, str(model))
    actors = [EngineWorker.options(num_cpus=0).remote(cfg, 1) for _ in range(2)]
    ray.get([a.ready.remote() for a in actors])
    yield actors, model
    for a in actors:
        ray.kill(a)


@pytest.fixture(scope="module")
def monkeypatch_module(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("MILES_LIKE_CACHE", str(tmp_path_factory.getbasetemp() / "miles_like_cache"))
    yield mp
    mp.undo()


def manager(function: str, engines, *more: str, front=None) -> RolloutManager:
    actors, model = engines
    recipe = recipe_with(function, *more)
    tok = load_tokenizer(model)
    source = PromptSource(recipe.data, tok, seed=recipe.seed, max_prompt_tokens=64)
    return RolloutManager(
        recipe,
        list(actors),
        tok,
        resolve_reward(recipe.reward.function),
        source,
        rollout_fn=resolve_rollout_function(function),
        context_len=512,
        vocab_size=tok.vocab_size,
        front=front,
    )


def test_multi_turn_trajectories_are_the_hand_built_conversation(engines):
    agent_rollouts.RECORDS.clear()
    rm = manager("agent_rollouts:three_turns", engines)
    try:
        rollout = rm.finish(rm.launch(0))
    finally:
        rm.close()
    tok = load_tokenizer(engines[1]).tok
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert len(agent_rollouts.RECORDS) == 6
    for rec in agent_rollouts.RECORDS:
        # the conversation, by hand: the user's prompt, then per turn the model's text and
        # the tool's message; the template's tokens between turns come from that conversation
        messages = [{"role": "user", "content": rec.prompt}]
        want_tokens, want_mask = list(rec.prompt_ids), []
        for turn, sampled in enumerate(rec.sampled):
            want_tokens += sampled
            want_mask += [1] * len(sampled)
            messages.append(
                {"role": "assistant", "content": tok.decode(sampled, skip_special_tokens=True)}
            )
            if turn < len(rec.sampled) - 1:
                new = [agent_rollouts.tool_message(sampled)]
                between = ([] if sampled[-1] == eos else [eos]) + chat.delta_ids(tok, messages, new)
                assert rec.appended[turn] == between
                want_tokens += between
                want_mask += [0] * len(between)
                messages += new
        t = rec.trajectory
        assert list(t.token_ids) == want_tokens and list(t.loss_mask) == want_mask
        assert t.prompt_len == len(rec.prompt_ids)
        flat_lp = [x for lps in rec.logprobs for x in lps]
        assert [x for x, m in zip(t.logprobs, t.loss_mask) if m] == flat_lp
        assert all(v == NOT_SAMPLED for v, m in zip(t.weight_versions, t.loss_mask) if not m)
        assert all(v == 0 for v, m in zip(t.weight_versions, t.loss_mask) if m)
    m = rollout.metrics
    assert m["turns_mean"] == 3.0 and m["tool_calls_mean"] == 2.0
    assert m["retokenize_mismatch"] == sum(
        r.trajectory.metrics["retokenize_mismatch"] for r in agent_rollouts.RECORDS
    )
    sampled = sum(len(s) for r in agent_rollouts.RECORDS for s in r.sampled)
    total = sum(r.trajectory.response_len for r in agent_rollouts.RECORDS)
    assert m["loss_mask_frac"] == pytest.approx(sampled / total, abs=1e-12)
    # later turns extend earlier ones on the same replica: most of their prefill is cached
    assert m["prefix_cache_hit_rate_turn2plus"] > 0.5
    assert m["generated_tokens"] == sampled


def test_sampling_seeds_are_the_single_turn_ones(engines):
    """ctx.sampling(j) alone samples what sample j of the group's n-sample request samples:
    per-sample seeds make one request of n and n requests of one the same draw."""
    rm = manager("agent_rollouts:three_turns", engines)
    try:
        grouped = rm.finish(rm.launch(0)).groups
        single = manager("single_turn", engines)
        try:
            ones = single.finish(single.launch(0)).groups
        finally:
            single.close()
    finally:
        rm.close()
    for multi, one in zip(grouped, ones):
        for t3, t1 in zip(multi.trajectories, one.trajectories):
            first = t1.response_len
            assert t3.token_ids[: t1.prompt_len + first] == t1.token_ids
            # the same draw; float64 log-probs of differently batched forwards may differ in
            # the last bit
            assert max(abs(a - b) for a, b in zip(t3.logprobs[:first], t1.logprobs)) <= 1e-12


def test_agent_code_through_the_openai_endpoint(engines):
    """rollout.serve_http: the official openai client, via the router at ctx.base_url, samples
    with ctx.sampling(j)'s seed exactly what the engine call of the single-turn rollout samples,
    and the router's sessions recorded those very tokens."""
    actors, model = engines
    front = HttpFront(list(actors), load_tokenizer(model).tok, timeout_s=120)
    try:
        rm = manager("agent_rollouts:openai_agent", engines, front=front)
        single = manager("single_turn", engines)
        try:
            served = rm.finish(rm.launch(0)).groups
            direct = single.finish(single.launch(0)).groups
        finally:
            rm.close()
            single.close()
        for got, want in zip(served, direct):
            for j, (a, b) in enumerate(zip(got.trajectories, want.trajectories)):
                assert a.token_ids == b.token_ids  # per-sample seeds: batching changes nothing
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-12
                (turn,) = front.sessions.get(f"{got.problem.prompt}#{j}")
                assert turn.prompt_token_ids + turn.token_ids == list(a.token_ids)
                assert turn.logprobs == list(a.logprobs)
    finally:
        front.close()
        ray.get([a.close.remote() for a in actors])


def test_the_openai_endpoint_in_prefill_decode_mode(engines):
    """rollout.prefill_replicas=1 with rollout.serve_http: a third replica only prefills; the
    decode replicas' endpoints prefill each request there (`engine_endpoint.RemotePrefill`),
    and the openai client samples what the single-turn rollout samples without disaggregation,
    as does the single-turn rollout in PD mode (`prefill_then_decode`)."""
    actors, model = engines
    cfg = engine_config(recipe_with("single_turn"), str(model))
    prefiller = EngineWorker.options(num_cpus=0).remote(cfg, 1)
    pd_actors = [prefiller, *actors]
    pd_engines = (pd_actors, model)
    pd = ("cluster.devices=3", "rollout.prefill_replicas=1")
    front = HttpFront(pd_actors, load_tokenizer(model).tok, timeout_s=120, prefill_replicas=1)
    try:
        rm = manager("agent_rollouts:openai_agent", pd_engines, *pd, front=front)
        single_pd = manager("single_turn", pd_engines, *pd)
        single = manager("single_turn", engines)
        try:
            served = rm.finish(rm.launch(0)).groups
            ray.get([a.close.remote() for a in pd_actors])
            decoded = single_pd.finish(single_pd.launch(0))
            direct = single.finish(single.launch(0)).groups
        finally:
            rm.close()
            single_pd.close()
            single.close()
        assert decoded.metrics["pd_transfer_bytes"] > 0
        for got, pd_got, want in zip(served, decoded.groups, direct, strict=True):
            for j, (a, p, b) in enumerate(
                zip(got.trajectories, pd_got.trajectories, want.trajectories)
            ):
                assert a.token_ids == p.token_ids == b.token_ids
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-12
                assert max(abs(x - y) for x, y in zip(p.logprobs, b.logprobs)) <= 1e-12
                (turn,) = front.sessions.get(f"{got.problem.prompt}#{j}")
                assert turn.prompt_token_ids + turn.token_ids == list(a.token_ids)
    finally:
        front.close()
        ray.get([a.close.remote() for a in pd_actors])
        ray.kill(prefiller)


def test_a_wave_for_two_decode_replicas_is_prefilled_in_one_call(engines):
    """Prefill-decode: the first turns of every group, queued on two decode replicas, leave as
    one wave, which the prefill replica serves in one `prefill` call (counted by the replica
    itself); so the prefix-cache counters are those of two plain replicas each prefilling its
    own batch in one call (the second call no longer finds the first's prompts in the cache),
    and the tokens are theirs. Fresh replicas on both sides: empty caches."""
    _, model = engines
    cfg = engine_config(recipe_with("single_turn"), str(model))
    fresh = [EngineWorker.options(num_cpus=0).remote(cfg, 1) for _ in range(5)]
    ray.get([a.ready.remote() for a in fresh])
    plain_actors, pd_actors = fresh[:2], fresh[2:]
    plain = manager("single_turn", (plain_actors, model))
    pd = manager(
        "single_turn", (pd_actors, model), "cluster.devices=3", "rollout.prefill_replicas=1"
    )
    try:
        want = plain.finish(plain.launch(0))
        got = pd.finish(pd.launch(0))
        stats = ray.get([a.stats.remote() for a in pd_actors])
    finally:
        plain.close()
        pd.close()
        for a in fresh:
            ray.kill(a)
    assert [s["prefill_calls"] for s in stats] == [1, 0, 0]
    assert all(s["forward_passes"] > 0 for s in stats[1:])  # both decode replicas decoded
    for key in ("prefix_cache_hit_rate", "prefix_cache_hit_rate_turn2plus"):
        assert got.metrics[key] == want.metrics[key]
    assert want.metrics["prefix_cache_hit_rate"] > 0  # the n samples share their prompt
    for a, b in zip(got.groups, want.groups, strict=True):
        assert [t.token_ids for t in a.trajectories] == [t.token_ids for t in b.trajectories]


def test_an_engine_killed_mid_conversation_is_replaced_and_nothing_changes(engines):
    """Engine 0 dies while it generates some turn: its call is sent again, with the same seeds,
    to a replacement (the controller's thread makes it), and every trajectory is the one a run
    without the death gives."""
    _, model = engines
    cfg = engine_config(recipe_with("single_turn"), str(model))
    mine = [EngineWorker.options(num_cpus=0).remote(cfg, 1) for _ in range(2)]
    ray.get([a.ready.remote() for a in mine])
    long = ("rollout.max_new_tokens=48",)
    reference = manager("agent_rollouts:three_turns", (mine, model), *long)
    try:
        want = reference.finish(reference.launch(0)).groups
    finally:
        reference.close()
    rm = manager("agent_rollouts:three_turns", (mine, model), *long)
    restarted = []

    def restart(i, died):
        ray.kill(rm.engines[i])
        rm.engines[i] = EngineWorker.options(num_cpus=0).remote(cfg, 1)
        restarted.append(i)
        return rm.engines[i]

    rm.restart_engine = restart
    victim = mine[0]
    # killed right after the first turn anywhere: every conversation on it is midway
    agent_rollouts.AFTER_FIRST_TURN[:] = [lambda: ray.kill(victim)]
    try:
        rollout = rm.finish(rm.launch(0))
    finally:
        agent_rollouts.AFTER_FIRST_TURN.clear()
        rm.close()
        for a in rm.engines:
            ray.kill(a)
    assert restarted == [0] and rollout.metrics["engine_restarts"] == 1
    for got, ref in zip(rollout.groups, want):
        assert [t.token_ids for t in got.trajectories] == [t.token_ids for t in ref.trajectories]
        assert [t.loss_mask for t in got.trajectories] == [t.loss_mask for t in ref.trajectories]


@pytest.mark.parametrize(
    "function,message",
    [
        ("agent_rollouts:raises", "KeyError: 'no such tool'"),
        (
            "agent_rollouts:too_few",
            ("returned list of 0 items; return a list of rollout.n=2 Trajectory"),
        ),
        ("agent_rollouts:bad_mask", "trajectory 0: loss_mask has"),
    ],
)
def test_a_broken_function_fails_the_step_in_one_line(engines, function, message):
    rm = manager(function, engines)
    try:
        with pytest.raises(RolloutFailed) as e:
            rm.finish(rm.launch(0))
    finally:
        rm.close()
    text = str(e.value)
    assert "\n" not in text and message in text
    assert text.startswith(f"rollout.function={function!r} failed on the prompt ")


def test_a_hung_function_stops_the_step_after_the_call_timeout(engines):
    rm = manager("agent_rollouts:hangs", engines, "cluster.call_timeout_s=2")
    try:
        with pytest.raises(
            RolloutFailed,
            match=r"rollout.function='agent_rollouts:hangs': no "
            r"progress within 2 s \(cluster.call_timeout_s\)",
        ):
            rm.finish(rm.launch(0))
    finally:
        rm.close()


def test_unknown_or_sync_functions_are_recipe_errors():
    with pytest.raises(RecipeError, match="is not an async function"):
        resolve_rollout_function("agent_rollouts:not_async")
    with pytest.raises(RecipeError, match="cannot import module 'no_such_module'"):
        resolve_rollout_function("no_such_module:fn")
    with pytest.raises(RecipeError, match="has no 'nope'"):
        resolve_rollout_function("agent_rollouts:nope")
    with pytest.raises(RecipeError, match=r"rollout.function='single turn': use a built-in"):
        load_recipe(RECIPE, ["rollout.function=single turn"])


def test_trajectory_check_names_the_problem():
    b = TrajectoryBuilder([1, 2])
    b.sampled([3, 4], [-0.5, -0.25], 2)
    b.appended([5])
    b.sampled([6], [-1.0], 3)
    t = b.build(response_text="x")
    t.check()
    assert t.loss_mask == (1, 1, 0, 1) and t.weight_versions == (2, 2, NOT_SAMPLED, 3)
    assert t.metrics == {"turns": 2.0} and t.sampled_tokens == 3 and t.response_len == 4
    cases = {
        "logprobs has 3 entries for the 4 tokens": {"logprobs": t.logprobs[:3]},
        "loss_mask must hold only 0 and 1": {"loss_mask": (1, 2, 0, 1)},
        "loss_mask has no sampled token": {"loss_mask": (0, 0, 0, 0)},
        "a token outside the loss mask has logprob -0.5": {"logprobs": (-0.5, -0.25, -0.5, -1.0)},
        "logprobs of a sampled token is 0.5": {"logprobs": (0.5, -0.25, 0.0, -1.0)},
        "weight_versions of a sampled token is -1": {"weight_versions": (-1, 2, -1, 3)},
        "prompt_len=0 must be": {"prompt_len": 0},
        "reward=nan": {"reward": float("nan")},
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=message):
            dataclasses.replace(t, **change).check()
    with pytest.raises(TypeError, match="response_text must be a str"):
        dataclasses.replace(t, response_text=None).check()
    assert isinstance(t, Trajectory)
