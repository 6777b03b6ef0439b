"""Recipe validation of rollout.over_sampling / partial / stream_scoring: each wrong
combination is one RecipeError line naming the field and the fix; the default is unchanged."""

from pathlib import Path

import pytest

from miles_like.recipe import RecipeError, load_recipe
from miles_like.rollouts.oversampling import launched, quotas
from miles_like.shares import near_equal_shares

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_arith_grpo.yaml"


def test_default_has_no_over_sampling():
    r = load_recipe(RECIPE).rollout
    assert (r.over_sampling, r.partial, r.stream_scoring) == (1.0, None, False)


def test_valid_combinations_load():
    r = load_recipe(RECIPE, ["rollout.over_sampling=1.5", "rollout.partial=retract"]).rollout
    assert (r.over_sampling, r.partial) == (1.5, "retract")
    assert load_recipe(RECIPE, ["rollout.stream_scoring=true"]).rollout.stream_scoring
    disaggregated = ["cluster.colocate=false", "cluster.devices=2"]
    r = load_recipe(
        RECIPE, ["rollout.over_sampling=2", "rollout.partial=in_place", *disaggregated]
    ).rollout
    assert (r.partial, r.max_carry_versions) == ("in_place", None)
    r = load_recipe(
        RECIPE,
        ["rollout.over_sampling=2", "rollout.partial=retract", "rollout.max_carry_versions=0"],
    ).rollout
    assert r.max_carry_versions == 0


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.over_sampling=0.5"], r"^rollout\.over_sampling"),
        (["rollout.partial=abort"], r"^rollout\.partial=abort needs groups left over: set "),
        (["rollout.over_sampling=1.5"], r"^rollout\.over_sampling=1\.5 leaves unfinished .*abort"),
        (
            ["rollout.over_sampling=1.5", "rollout.partial=in_place"],
            r"^rollout\.partial=in_place keeps KV .* colocated .*retract$",
        ),
        (
            ["rollout.over_sampling=1.5", "rollout.partial=abort", "rollout.max_carry_versions=1"],
            r"^rollout\.max_carry_versions=1 bounds carried groups, .*max_carry_versions: null$",
        ),
        (
            [
                "rollout.over_sampling=1.5",
                "rollout.partial=retract",
                "rollout.max_carry_versions=-1",
            ],
            r"^rollout\.max_carry_versions",
        ),
        (
            ["rollout.over_sampling=1.5", "rollout.partial=abort", "rollout.function=tool_loop"],
            r"^rollout\.over_sampling works with rollout\.function: single_turn",
        ),
        (
            ["rollout.stream_scoring=true", "rollout.function=my_mod:fn"],
            r"^rollout\.stream_scoring works with rollout\.function: single_turn",
        ),
        (
            ["rollout.over_sampling=2", "rollout.partial=abort", "algorithm.dynamic_sampling=true"],
            r"^rollout\.over_sampling and algorithm\.dynamic_sampling",
        ),
    ],
)
def test_wrong_combinations_are_one_line_errors(overrides, message):
    with pytest.raises(RecipeError, match=message) as e:
        load_recipe(RECIPE, overrides, check_paths_exist=False)
    assert "\n" not in str(e.value)


def test_launched_groups_and_quotas():
    assert launched(4, 1.5) == 6 and launched(32, 1.0) == 32 and launched(5, 1.5) == 8
    # each replica's quota fits in its share of the launched groups
    for batch, over, replicas in [(4, 1.5, 2), (5, 1.25, 3), (7, 1.01, 4), (3, 2.0, 4)]:
        shares = near_equal_shares(launched(batch, over), replicas)
        q = quotas(batch, shares)
        assert sum(q) == batch
        assert all(k <= len(s) for k, s in zip(q, shares))
