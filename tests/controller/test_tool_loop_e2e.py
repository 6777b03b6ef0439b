"""The tool loop end to end on real actors: the calculator recipe, scaled down (a short warm
start that teaches the call format, one rollout, one train step), and its real trajectories
checked against an independent replay of each conversation:

* trained tokens == prompt + sampled turns + the template's tokens for the tool messages, where
  the replay parses each sampled turn itself, runs the calls itself and renders the deltas;
* the loss mask is 1 exactly on the sampled turns, which carry the engine's log-probs;
* the reward is the exact match of the final answer; the metrics count turns and calls;
* the trainer's log-probs of the sampled tokens equal the engine's (float64).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miles_like.recipe import load_recipe
from miles_like.rollouts.tools import ToolPool, load_tools
from miles_like.run import bringup
from miles_like.scoring.batch import samples_batch, with_advantages
from miles_like.tasks import arith, calc
from rollout import chat

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def replay(t, problem, tok, pool: ToolPool) -> dict:
    """Rebuild trajectory `t` from its sampled turns alone; returns what the replay found."""
    response = list(t.token_ids[t.prompt_len :])
    segments = runs(list(t.loss_mask))
    assert segments[0][0] == 1, "a response starts with a sampled turn"
    messages = [{"role": "user", "content": problem.prompt}]
    rebuilt, calls, final = list(problem.prompt_ids), 0, None
    for k, (value, start, end) in enumerate(segments):
        piece = response[start:end]
        if value == 0:
            continue  # rebuilt below from the turn before it
        rebuilt += piece
        text = tok.decode(piece, skip_special_tokens=True)
        stopped = piece[-1] == tok.tok.eos_token_id
        try:
            content, parsed = chat.parse_tool_calls(text) if stopped else (text, None)
        except chat.ToolCallError as e:
            content, parsed, error = text, [], str(e)
        else:
            error = None
        messages.append(chat.assistant_message(content if parsed or error else text, parsed or []))
        if stopped and not parsed and error is None:
            final = content
        if k + 1 < len(segments):  # the loop appended the tool messages of this turn
            if error is not None:
                replies = [{"role": "tool", "name": "error", "content": f"error: {error}"}]
            else:
                calls += len(parsed)
                replies = [
                    {
                        "role": "tool",
                        "name": c.name,
                        "content": pool.call(c.name, c.arguments).content,
                    }
                    for c in parsed
                ]
            delta = chat.delta_ids(tok.tok, messages, replies)
            _, s0, e0 = segments[k + 1]
            assert response[s0:e0] == delta, "appended tokens are not the template's delta"
            rebuilt += delta
            messages += replies
    assert rebuilt == list(t.token_ids)
    return {"calls": calls, "final": final, "turns": sum(v for v, _, _ in segments)}


def test_calc_agent_trajectories_are_token_exact(ray_local, cache, tmp_path):
    recipe = load_recipe(
        ROOT / "recipes/tiny_calc_agent_grpo.yaml",
        [
            f"tracking.output_dir={tmp_path}",
            "sft.steps=120",
            "sft.batch_size=32",
            "rollout.prompts_per_step=4",
            "rollout.n=4",
            "rollout.kv_cache_tokens=8192",
            "trainer.updates_per_rollout=1",
            "model.dtype=float64",
        ],
    )
    run = bringup.start(recipe, log=print)
    try:
        rollout = run.rollouts.finish(run.rollouts.launch(0))
        tok = run.tokenizer
        totals = {"calls": 0, "multi_turn": 0}
        with ToolPool(load_tools(recipe.rollout.tools)) as pool:
            for g in rollout.groups:
                assert len(g.trajectories) == 4
                for t in g.trajectories:
                    t.check()  # mask 1 <=> engine log-prob < 0 and a weight version
                    found = replay(t, g.problem, tok, pool)
                    assert t.metrics["turns"] == found["turns"] <= recipe.rollout.max_turns
                    assert t.metrics["tool_calls"] == found["calls"]
                    expect = (
                        0.0
                        if found["final"] is None
                        else arith.score(found["final"], g.problem.answer)
                    )
                    assert t.reward == expect and t.response_text == (found["final"] or "")
                    totals["calls"] += found["calls"]
                    totals["multi_turn"] += found["turns"] > 1
        # the warm start taught the format: the rollout did call the tool and read results
        assert totals["calls"] > 0 and totals["multi_turn"] > 0
        m = rollout.metrics
        assert m["turns_mean"] > 1.0 and m["tool_calls_mean"] > 0.0
        assert 0.0 < m["loss_mask_frac"] < 1.0
        assert m["tool_errors"] == sum(
            m[f"tool_errors_{k}"]
            for k in (
                "raised",
                "timeout",
                "crashed",
                "flood",
                "bad_args",
                "unknown",
                "unavailable",
                "bad_call",
            )
        )
        # trainer vs engine log-probs on the sampled tokens, before the update (float64)
        batch, _ = with_advantages(samples_batch(rollout.groups), rollout.groups, recipe.algorithm)
        metrics = run.actors.train(batch)
        assert metrics["logprob_diff_max"] <= 1e-10
    finally:
        run.shutdown()


def test_calculator_is_what_the_recipe_names():
    (tool,) = load_tools(load_recipe(ROOT / "recipes/tiny_calc_agent_grpo.yaml").rollout.tools)
    assert tool.spec == calc.TOOL_SPEC and tool.name == "calculator"
