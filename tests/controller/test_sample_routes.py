"""A mixture of experts' routes on the controller side (`rollouts.sample_routes`): what a sample
keeps across turns and continuations, its checkpoint form, the batch's routes, each trainer
rank's share of them, and the recipe's `algorithm.routing_replay`.

The reference for the routes a multi-turn trajectory keeps is the engine itself: a cold prefill
of the whole final sequence on the same weights routes every token as the turns did (the
engine's routes of a prefix-cache hit are those of the prefill that computed it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from miles_like.data import Problem
from miles_like.errors import RecipeError
from miles_like.models import store as model_store
from miles_like.recipe.preflight import replays_routes
from miles_like.recipe.recipe import Recipe
from miles_like.recipe.sections import ModelSection
from miles_like.rollouts import sample_routes
from miles_like.rollouts.group_scoring import Group
from miles_like.rollouts.partial import EMPTY, OpenGroup, from_state, to_state
from miles_like.rollouts.replica_batcher import Generation
from miles_like.rollouts.trajectory import TrajectoryBuilder, single_turn
from miles_like.run.trainer_worker import mini_batches, route_shares
from miles_like.scoring.batch import samples_batch
from trainer.packing import pack_all
from trainer.routing_replay import packed_routes


def routes(rows: int, fill: int, layers: int = 2, k: int = 2) -> torch.Tensor:
    return torch.full((rows, layers, k), fill, dtype=torch.uint8)


def test_extend_keeps_the_rows_a_sample_has_and_appends_the_new_ones():
    kept = routes(4, 1)
    out = sample_routes.extend(kept, routes(7, 2), tokens=8)
    assert out.tolist() == routes(4, 1).tolist() + routes(3, 2).tolist()
    assert sample_routes.extend(None, routes(3, 5), tokens=4).equal(routes(3, 5))
    # a request that computed nothing new (aborted before it ran) leaves the rows as they were
    assert sample_routes.extend(kept, routes(0, 9), tokens=5).equal(kept)
    assert sample_routes.extend(None, None, tokens=3) is None
    with pytest.raises(ValueError, match="at most|for a sequence of 4 tokens"):
        sample_routes.extend(None, routes(4, 0), tokens=4)
    with pytest.raises(ValueError, match="continue routes"):
        sample_routes.extend(kept, routes(6, 0, layers=3), tokens=7)
    with pytest.raises(ValueError, match="no routes"):
        sample_routes.extend(kept, None, tokens=6)


def test_the_checkpoint_form_is_exact():
    r = torch.randint(0, 256, (5, 3, 2), dtype=torch.uint8)
    import json

    back = sample_routes.from_state(json.loads(json.dumps(sample_routes.to_state(r))))
    assert back.dtype == torch.uint8 and back.equal(r)
    assert sample_routes.from_state(sample_routes.to_state(routes(0, 0))).shape == (0, 2, 2)
    assert sample_routes.from_state(None) is None and sample_routes.to_state(None) is None


def test_partial_samples_keep_their_routes_through_a_checkpoint():
    first = Generation([7, 8], [-0.1, -0.2], "abort", 0, routes=routes(4, 1))  # prompt of 3
    part = EMPTY.extended(first)
    assert part.routes.equal(routes(4, 1))
    # continued under new weights: prompt + 2 tokens are its input; the rows it had stay
    cont = part.extended(Generation([9], [-0.3], "stop", 1, routes=routes(5, 2)))
    assert cont.routes.tolist() == routes(4, 1).tolist() + routes(1, 2).tolist()
    group = OpenGroup(Problem("p", [1, 2, 3], "a"), (part, EMPTY))
    (back,) = from_state(to_state([group]))
    assert back.samples[0].routes.equal(part.routes) and back.samples[1].routes is None


def test_a_trajectory_needs_routes_from_every_turn_or_none():
    b = TrajectoryBuilder([5, 6])
    b.sampled([1, 2], [-0.1, -0.2], 0, routes=routes(3, 1))
    b.appended([7, 7])
    b.sampled([3], [-0.3], 0)  # no routes this turn
    with pytest.raises(ValueError, match="1 of 2 turns gave routes"):
        b.build(response_text="")
    with pytest.raises(ValueError, match="for a sequence of 3 tokens"):
        single_turn([5], [1, 2], [-0.1, -0.2], 0, "stop", "", routes(5, 0))
    # a rollout function's own trajectory is checked as it comes back
    t = single_turn([5], [1, 2], [-0.1, -0.2], 0, "stop", "", routes(2, 0))
    t.check()
    with pytest.raises(ValueError, match="has 1 rows for 3 tokens"):
        dataclasses.replace(t, routes=routes(1, 0)).check()


def test_the_batch_carries_routes_of_every_trajectory_or_none():
    with_routes = single_turn([5], [1, 2], [-0.1, -0.2], 0, "stop", "", routes(2, 3))
    without = single_turn([5], [1, 2], [-0.1, -0.2], 0, "stop", "")
    group = Group(Problem("p", [5], "a"), [with_routes, with_routes], [1.0, 0.0], [1.0, 0.0])
    batch = samples_batch([group])
    assert [r.tolist() for r in batch.routed_experts] == [routes(2, 3).tolist()] * 2
    assert samples_batch([group._replace(trajectories=[without, without])]).routed_experts is None
    with pytest.raises(ValueError, match="1 of 2 trajectories have routes"):
        samples_batch([group._replace(trajectories=[with_routes, without])])


@pytest.mark.parametrize("n, updates, dp", [(8, 1, 2), (7, 2, 2), (9, 3, 3), (4, 4, 1)])
def test_each_data_parallel_rank_gets_the_routes_of_its_own_forwards(n, updates, dp):
    """The trainer's own split: every mini-batch (`mini_batches`) subset, then the strided DP
    share of it (`dp_share`); a rank that lacks a route it packs is refused by the trainer."""
    shares = route_shares(n, updates, dp)
    assert sorted(sum(shares, [])) == list(range(n))
    tokens = [[1, 2, 3 + i] for i in range(n)]
    full = [routes(2, i) for i in range(n)]
    for rank in range(dp):
        given = [r if i in shares[rank] else None for i, r in enumerate(full)]
        for mini in mini_batches(n, updates):
            local = [mini[j] for j in range(rank, len(mini), dp)]  # dp_share of the subset
            toks = [tokens[i] for i in local]
            (mb,) = pack_all(toks, [2] * len(local), 10_000, False)
            out = packed_routes(mb, toks, [2] * len(local), [given[i] for i in local])
            assert out[:2].tolist() == full[local[0]].long().tolist()
        other = [i for i in range(n) if i not in shares[rank]]
        if other:
            toks = [tokens[other[0]]]
            (mb,) = pack_all(toks, [2], 10_000, False)
            with pytest.raises(ValueError, match="no routes for samples"):
                packed_routes(mb, toks, [2], [None])


def recipe(**sections) -> Recipe:
    return Recipe(model={"builtin": "tiny-qwen3-moe"}, data={"synthetic": "arith"}, **sections)


def test_the_recipe_field_resolves_for_the_model_and_backend():
    dense, moe = {"model_type": "qwen3"}, {"model_type": "qwen3_moe"}
    assert replays_routes(recipe(), moe) and not replays_routes(recipe(), dense)
    assert not replays_routes(recipe(algorithm={"routing_replay": "off"}), moe)
    assert not replays_routes(recipe(algorithm={"routing_replay": False}), moe)  # YAML's `off`
    on = recipe(algorithm={"routing_replay": "rollout"})
    assert replays_routes(on, moe)
    with pytest.raises(RecipeError, match="routing_replay=rollout.*not a mixture"):
        replays_routes(on, dense)
    # the deepspeed backend replays on HF's mixture (`trainer.hf_routing_replay`): the same
    assert replays_routes(recipe(trainer={"backend": "deepspeed"}), moe)
    deepspeed_on = recipe(trainer={"backend": "deepspeed"}, algorithm={"routing_replay": "rollout"})
    assert replays_routes(deepspeed_on, moe)
    with pytest.raises(RecipeError, match="routing_replay=rollout.*not a mixture"):
        replays_routes(deepspeed_on, dense)


def test_multi_turn_routes_equal_a_cold_prefill_of_the_whole_sequence(tmp_path, monkeypatch):
    from rollout import Engine, EngineConfig, SamplingParams

    monkeypatch.setenv("MILES_LIKE_CACHE", str(tmp_path))
    directory = model_store.base_model_dir(ModelSection(builtin="tiny-qwen3-moe"), seed=0)
    engine = Engine(EngineConfig(model_path=str(directory), kv_cache_tokens=512, page_size=4))

    def generate(ids, seed, new=5):
        params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=seed)
        rid = engine.add_request(list(ids), params)
        outs = []
        while engine.has_unfinished():
            outs += engine.step()
        (out,) = [o for o in outs if o.request_id == rid]
        s = out.samples[0]
        return Generation(s.token_ids, s.logprobs, s.finish_reason, 0, routes=out.routed_experts[0])

    b = TrajectoryBuilder([10, 11, 12, 13, 14])
    for turn in range(3):
        g = generate(b.token_ids, seed=turn)
        b.sampled(g.token_ids, g.logprobs, 0, g.finish_reason, routes=g.routes)
        if turn < 2:
            b.appended([20 + turn, 30, 31])
    t = b.build(response_text="")
    assert t.routes.shape[0] == len(t.token_ids) - 1
    engine.flush_prefix_cache()
    cold = generate(t.token_ids, seed=9, new=1).routes
    assert t.routes.equal(cold[: len(t.token_ids) - 1])
