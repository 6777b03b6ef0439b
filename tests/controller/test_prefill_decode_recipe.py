"""Recipe validation of rollout.prefill_replicas: off by default, over-sampling with partial
rollouts served; a value that leaves no decode replica, or that meets what prefill-decode does
not serve yet, is one RecipeError line naming the field and the fix."""

from pathlib import Path

import pytest

from miles_like.recipe import RecipeError, load_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny_arith_grpo.yaml"
THREE = ["cluster.devices=3"]  # colocated: three engine replicas


def test_default_is_off_and_valid_values_load():
    assert load_recipe(RECIPE).rollout.prefill_replicas == 0
    assert load_recipe(RECIPE, [*THREE, "rollout.prefill_replicas=2"]).rollout.prefill_replicas
    disaggregated = ["cluster.devices=4", "cluster.colocate=false", "cluster.rollout_devices=3"]
    r = load_recipe(RECIPE, [*disaggregated, "rollout.prefill_replicas=1"]).rollout
    assert r.prefill_replicas == 1
    r = load_recipe(RECIPE, [*THREE, "rollout.prefill_replicas=1", "rollout.serve_http=true"])
    assert r.rollout.serve_http
    # engine TP: one prefill and one decode replica of 2 ranks each
    r = load_recipe(RECIPE, ["cluster.devices=4", "rollout.tp=2", "rollout.prefill_replicas=1"])
    assert (r.rollout.tp, r.rollout.prefill_replicas) == (2, 1)
    # over-sampling with partial rollouts (`rollouts/oversampling.py`)
    for extra in (
        ["rollout.over_sampling=1.5", "rollout.partial=retract"],
        ["rollout.partial=abort", "rollout.over_sampling=2"],
    ):
        r = load_recipe(RECIPE, [*THREE, "rollout.prefill_replicas=1", *extra]).rollout
        assert r.prefill_replicas == 1
    # in_place (disaggregated engines): a continuation goes to the decode replica that parked
    in_place = ["rollout.over_sampling=1.5", "rollout.partial=in_place"]
    r = load_recipe(RECIPE, [*disaggregated, "rollout.prefill_replicas=1", *in_place]).rollout
    assert (r.partial, r.prefill_replicas) == ("in_place", 1)
    # streaming scoring: the over-sampled rollout's path with a quota of every group
    r = load_recipe(RECIPE, [*THREE, "rollout.prefill_replicas=1", "rollout.stream_scoring=true"])
    assert r.rollout.stream_scoring
    # fully asynchronous (single-turn): the producer's waves prefilled, then decoded
    r = load_recipe(
        RECIPE, [*disaggregated, "rollout.prefill_replicas=1", "cluster.fully_async=true"]
    )
    assert r.cluster.fully_async and r.rollout.prefill_replicas == 1


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["rollout.prefill_replicas=-1"], r"^rollout\.prefill_replicas"),
        (["rollout.prefill_replicas=1"], r"leaves no decode replica of the 1 engine replicas; "),
        (  # two devices of TP 2: one replica
            ["cluster.devices=2", "rollout.tp=2", "rollout.prefill_replicas=1"],
            r"leaves no decode replica of the 1 engine replicas; ",
        ),
        ([*THREE, "rollout.prefill_replicas=3"], r"no decode replica of the 3 engine replicas"),
        (
            [
                *THREE,
                "rollout.prefill_replicas=1",
                "rollout.speculative_method=draft",
                f"rollout.speculative_draft_model_path={ROOT}",
            ],
            r"speculative_method=draft",
        ),
        (
            [
                "cluster.devices=4",
                "cluster.colocate=false",
                "cluster.rollout_devices=3",
                "rollout.prefill_replicas=1",
                "cluster.fully_async=true",
                "rollout.function=tool_loop",
            ],
            r"does not support cluster\.fully_async with rollout\.function='tool_loop' "
            r"\(multi-turn\) yet; turn one of them off$",
        ),
    ],
)
def test_bad_values_are_one_line(overrides, message):
    with pytest.raises(RecipeError, match=message) as e:
        load_recipe(RECIPE, overrides)
    assert "\n" not in str(e.value)
    assert "prefill_replicas" in str(e.value)


def test_local_prefill_threshold_defaults_and_bad_values_are_one_line():
    """rollout.pd_local_prefill_tokens: 256 by default, 0 allowed (every request through a
    prefill replica); a negative or non-integer value is one line naming the field and the fix."""
    assert load_recipe(RECIPE).rollout.pd_local_prefill_tokens == 256
    r = load_recipe(
        RECIPE, [*THREE, "rollout.prefill_replicas=1", "rollout.pd_local_prefill_tokens=0"]
    )
    assert r.rollout.pd_local_prefill_tokens == 0
    for value, fix in (("-1", r"use a value in \[0, inf\)$"), ("many", r"of type int$")):
        with pytest.raises(RecipeError, match=fix) as e:
            load_recipe(RECIPE, [f"rollout.pd_local_prefill_tokens={value}"])
        assert "\n" not in str(e.value)
        assert str(e.value).startswith("rollout.pd_local_prefill_tokens")
