"""The tool loop's tokenization without an engine: warm-start demonstrations are the chat
template's rendering of the whole conversation, with loss mask 1 exactly on the assistant turns
(checked against the rendered text, segment by segment), and the recipe rules of the loop."""

from __future__ import annotations

import pytest
import torch

from miles_like.data import Problem
from miles_like.models.tokenizer import builtin_tokenizer
from miles_like.recipe import RecipeError, load_recipe
from miles_like.rollouts.tool_loop import demonstration
from miles_like.rollouts.tools import load_tools
from miles_like.run.warm_start import demonstrations, sft_batch
from miles_like.tasks import calc
from rollout import chat

RECIPE = "recipes/tiny_calc_agent_grpo.yaml"
TOK = builtin_tokenizer()
IM_START, IM_END = "<|im_start|>assistant\n", "<|im_end|>"


def problem(prompt: str, answer: str) -> Problem:
    return Problem(prompt, TOK.encode_prompt(prompt, True), answer)


def expected_tokens_and_mask(messages, tools):
    """The whole conversation rendered as text by the template, cut into segments at each
    assistant turn's content (mask 1: the content and its end-of-turn token) and encoded
    segment by segment (the character vocabulary has no merges to cross a cut)."""
    text = chat.render_text(TOK.tok, messages, tools, add_generation_prompt=False)
    tokens, mask, pos = [], [], 0
    while (start := text.find(IM_START, pos)) >= 0:
        start += len(IM_START)
        end = text.index(IM_END, start) + len(IM_END)
        for piece, m in ((text[pos:start], 0), (text[start:end], 1)):
            ids = chat.encode_text(TOK.tok, piece)
            tokens += ids
            mask += [m] * len(ids)
        pos = end
    return tokens, mask


@pytest.mark.parametrize("with_schemas", [False, True])
def test_a_demonstration_is_the_rendered_conversation_masked_on_assistant_turns(with_schemas):
    tools = [t.schema for t in load_tools([calc.TOOL_SPEC])] if with_schemas else None
    p = problem("347*28=", "9716")
    solution = calc.demonstration(p.prompt, p.answer, ("calculator",))
    t = demonstration(TOK, p, solution, tools)
    tokens, mask = expected_tokens_and_mask(
        [{"role": "user", "content": p.prompt}, *solution], tools
    )
    assert list(t.token_ids) == tokens
    assert [0] * t.prompt_len + list(t.loss_mask) == mask
    assert t.response_text == "9716" and sum(t.loss_mask) > 60  # the call and the answer
    # the tool's result is in the trajectory, outside the loss
    text = TOK.decode(list(t.token_ids), skip_special_tokens=False)
    assert "<tool_response>\n9716\n</tool_response>" in text


def test_without_the_tool_a_demonstration_is_the_bare_answer():
    p = problem("347*28=", "9716")
    t = demonstration(TOK, p, calc.demonstration(p.prompt, p.answer, ()), None)
    assert list(t.token_ids) == p.prompt_ids + TOK.encode_response("9716")
    assert set(t.loss_mask) == {1}


def test_sft_batch_of_conversations_carries_the_masks():
    recipe = load_recipe(RECIPE)
    demonstrate, tools = demonstrations(recipe)
    assert tools is None  # the recipe keeps the schemas out of the prompt
    problems = [problem("12+345=", "357"), problem("999*999=", "998001")]
    batch = sft_batch(problems, TOK, demonstrate, tools)
    for i, p in enumerate(problems):
        t = demonstration(TOK, p, calc.demonstration(p.prompt, p.answer, ("calculator",)), None)
        assert batch.tokens[i] == list(t.token_ids) and batch.prompt_lens[i] == t.prompt_len
        assert torch.equal(batch.loss_masks[i], torch.tensor(t.loss_mask, dtype=torch.float32))
    # the ablation's recipe demonstrates bare answers
    demonstrate, _ = demonstrations(load_recipe(RECIPE, ["rollout.tools=[]"]))
    assert demonstrate(problems[0]) == [{"role": "assistant", "content": "357"}]


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("rollout.max_trajectory_tokens=50", "below rollout.max_new_tokens=96"),
        ("rollout.max_trajectory_tokens=4096", "leaves no room for a prompt"),
        ("data.chat_template=false", "set data.chat_template: true"),
        ("rollout.tools=[calc]", "rollout.tools[0]='calc': name a tool as module:function"),
        ("rollout.tools=[miles_like.tasks.calc:nothing]", "has no 'nothing'"),
    ],
)
def test_recipe_rules_of_the_tool_loop(override, fragment):
    with pytest.raises(RecipeError) as e:
        load_recipe(RECIPE, [override])
    assert fragment in str(e.value)


def test_the_e2e_replay_accepts_a_true_conversation_and_rejects_a_corrupted_one():
    from test_tool_loop_e2e import replay

    from miles_like.rollouts.tools import ToolPool
    from miles_like.rollouts.trajectory import Trajectory

    p = problem("347*28=", "9716")
    t = demonstration(TOK, p, calc.demonstration(p.prompt, p.answer, ("calculator",)), None)
    with ToolPool(load_tools([calc.TOOL_SPEC]), workers=1) as pool:
        assert replay(t, p, TOK, pool) == {"calls": 1, "final": "9716", "turns": 2}
        response = list(t.token_ids[t.prompt_len :])
        k = t.loss_mask.index(0) + 5  # inside the tool result's tokens
        response[k] = TOK.tok.convert_tokens_to_ids("7")
        bad = Trajectory(
            t.token_ids[: t.prompt_len] + tuple(response),
            t.prompt_len,
            t.loss_mask,
            t.logprobs,
            t.weight_versions,
        )
        with pytest.raises(AssertionError, match="not the template's delta"):
            replay(bad, p, TOK, pool)
