"""Recipe validation of cluster.fully_async / max_staleness / async_buffer_groups: each wrong
combination is one RecipeError line naming the field and the fix; the default is unchanged."""

from pathlib import Path

import pytest

from miles_like.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_arith_grpo.yaml"
DISAGG = ["cluster.devices=2", "cluster.colocate=false"]
ASYNC = [*DISAGG, "cluster.fully_async=true"]


def test_default_is_synchronous():
    c = load_recipe(RECIPE).cluster
    assert (c.fully_async, c.max_staleness, c.async_buffer_groups) == (False, 1, None)


def test_buffer_default_is_one_batch_per_version_of_lag():
    r = load_recipe(RECIPE, [*ASYNC, "rollout.prompts_per_step=8", "cluster.max_staleness=2"])
    assert r.async_buffer_groups == 8 * 3
    r = load_recipe(RECIPE, [*ASYNC, "cluster.max_staleness=0"])
    assert r.async_buffer_groups == r.rollout.prompts_per_step
    r = load_recipe(RECIPE, [*ASYNC, "cluster.async_buffer_groups=100"])
    assert r.async_buffer_groups == 100
    # retract (or null) and abort both say what happens to running requests at an update
    assert load_recipe(RECIPE, [*ASYNC, "rollout.partial=abort"]).rollout.partial == "abort"
    assert load_recipe(RECIPE, [*ASYNC, "rollout.partial=retract"]).rollout.partial == "retract"
    # in_place keeps the running requests and their K/V across the update (no over-sampling)
    r = load_recipe(RECIPE, [*ASYNC, "rollout.partial=in_place"])
    assert r.rollout.partial == "in_place"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["cluster.fully_async=true"],
            r"^cluster\.fully_async=true keeps the engines generating .* cluster\.colocate: false$",
        ),
        (
            [*ASYNC, "cluster.off_policy_steps=1"],
            r"^cluster\.fully_async=true bounds the lag .* cluster\.off_policy_steps: 0$",
        ),
        ([*ASYNC, "cluster.max_staleness=-1"], r"^cluster\.max_staleness"),
        (
            [*ASYNC, "cluster.async_buffer_groups=10"],
            r"^cluster\.async_buffer_groups=10 cannot hold one batch of "
            r"rollout\.prompts_per_step=64 groups; raise it to >= 64 or null$",
        ),
        (
            [*DISAGG, "cluster.async_buffer_groups=100"],
            r"^cluster\.async_buffer_groups applies to fully asynchronous training; set "
            r"cluster\.fully_async: true or remove cluster\.async_buffer_groups$",
        ),
        (
            [*DISAGG, "cluster.max_staleness=3"],
            r"^cluster\.max_staleness applies to fully asynchronous training",
        ),
        (
            [*DISAGG, "cluster.take_ahead=false"],
            r"^cluster\.take_ahead applies to fully asynchronous training; set "
            r"cluster\.fully_async: true or remove cluster\.take_ahead$",
        ),
        (
            [*ASYNC, "rollout.over_sampling=1.5", "rollout.partial=retract"],
            r"^rollout\.over_sampling: cluster\.fully_async=true keeps the engines full",
        ),
        (
            [
                *ASYNC,
                "cluster.devices=4",
                "rollout.tp=2",
                "trainer.tp=2",
                "trainer.backend=megatron",
                "rollout.partial=in_place",
            ],
            r"^rollout\.partial=in_place updates running engines with full tensors, but "
            r"trainer\.tp = rollout\.tp = 2 .* use rollout\.partial: retract$",
        ),
        (
            [*ASYNC, "rollout.max_carry_versions=2", "rollout.partial=retract"],
            r"^rollout\.max_carry_versions bounds synchronous over-sampling; .*max_staleness",
        ),
        (
            [*ASYNC, "rollout.function=agent_rollouts:three_turns", "rollout.partial=in_place"],
            r"^rollout\.partial=in_place keeps single-turn requests running through an update; "
            r".* use rollout\.partial: retract \(or null\)$",
        ),
        (
            [*ASYNC, "rollout.function=agent_rollouts:three_turns", "rollout.serve_http=true"],
            r"^rollout\.serve_http: cluster\.fully_async=true tracks each engine call's weight "
            r"versions through ctx\.generate, which HTTP requests bypass",
        ),
    ],
)
def test_wrong_combinations_are_one_line_errors(overrides, message):
    with pytest.raises(RecipeError, match=message) as e:
        load_recipe(RECIPE, overrides)
    assert "\n" not in str(e.value)


def test_the_issue_spelling_names_the_field():
    """`cluster.async` (a Python keyword, so not a field name) points at cluster.fully_async."""
    with pytest.raises(
        RecipeError, match=r"^cluster\.async: unknown key; did you mean cluster\.fully_async\?$"
    ):
        load_recipe(RECIPE, [*DISAGG, "cluster.async=true"])
