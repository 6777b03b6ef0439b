"""Property test over the recipe schema: whatever a user writes, loading a recipe either succeeds or
raises one `RecipeError` whose message is a single line; never any other exception.

Recipes are generated as a valid base recipe with random edits: any known field (or a misspelt
or unknown one) set to an arbitrary YAML value (None, bools, ints incl. huge and negative,
floats incl. nan / inf, strings, lists, nested mappings), whole sections replaced by junk, and
random override strings. Hypothesis shrinks any failure to a minimal recipe.
"""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from config_schema import describe
from miles_like.recipe import Recipe, RecipeError, load_recipe

FIELDS = [name for name, *_ in describe(Recipe)]
SECTIONS = sorted({f.split(".")[0] for f in FIELDS if "." in f})
BASE = {"model": {"builtin": "tiny-qwen2"}, "data": {"synthetic": "arith"}, "steps": 3}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(
        [
            "1e-6",
            "grpo",
            "megatron",
            "auto",
            "+-",
            "arith",
            "tiny-qwen2",
            "ngram",
            "float32",
            "null",
            "-1",
            "0",
            "inf",
            "nan",
        ]
    ),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=6,
)
keys = st.one_of(
    st.sampled_from(FIELDS),
    st.sampled_from(SECTIONS),
    st.sampled_from(FIELDS).map(lambda f: f[:-1] + "x"),  # misspelt
    st.text(alphabet="abcdefgh._", min_size=1, max_size=10),
)  # anything


def set_dotted(data: dict, key: str, value) -> None:
    parts = [p for p in key.split(".") if p] or ["x"]
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = node[part] = {}
        node = child
    node[parts[-1]] = value


override_text = st.text(alphabet="abcdefghilmnoprstuwy._=-0123456789:[]{}' ", max_size=25)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(st.tuples(keys, values), max_size=4),
    overrides=st.lists(
        st.one_of(
            override_text,
            st.tuples(st.sampled_from(FIELDS), scalars).map(
                lambda kv: f"{kv[0]}={yaml.safe_dump(kv[1]).strip()}"
            ),
        ),
        max_size=2,
    ),
)
def test_any_recipe_loads_or_fails_in_one_line(tmp_path_factory, edits, overrides):
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in BASE.items()}
    for key, value in edits:
        set_dotted(data, key, value)
    path = tmp_path_factory.mktemp("fuzz") / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        load_recipe(path, overrides, check_paths_exist=False)
    except RecipeError as e:
        message = str(e)
        assert message and "\n" not in message
