"""Tools that hang, crash and flood never stall a rollout: real engine replicas, the built-in
tool loop and its tool pool, and a model that calls them.

The model is the built-in tiny Qwen2 taught (HF transformers, a few hundred steps on one
conversation) to answer the prompt with four tool calls in one turn: `hang` (sleeps an hour),
`exit_hard` (`os._exit`), `flood` (returns far more than the output cap) and `add`. Two steps of
rollouts run with a 2 s tool timeout; each must end in a small multiple of that timeout, with
every trajectory carrying the three error strings as tool messages (counted by kind) and the
well-behaved tool's real result, and the second step finds the pool's replaced workers serving.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from miles_like.data import Problem, PromptSource
from miles_like.models.store import base_model_dir, copy_model_files
from miles_like.models.tokenizer import load_tokenizer
from miles_like.recipe import load_recipe
from miles_like.recipe.build_configs import engine_config
from miles_like.rollouts import tool_loop
from miles_like.rollouts.functions import resolve_rollout_function
from miles_like.rollouts.manager import RolloutManager
from miles_like.run.engine_worker import EngineWorker
from miles_like.scoring.rewards import resolve_reward

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "tiny_arith_grpo.yaml")
PROMPT, ANSWER = "use every tool", "done"
TIMEOUT_S = 2.0
OUTPUT_CAP = 200
CALLS = [
    ("hang", {}),
    ("exit_hard", {}),
    ("flood", {"n": 100_000}),
    ("add", {"a": 2, "b": 3}),
]
pytestmark = pytest.mark.slow


def recipe(data_path: Path, model_path: Path | None = None):
    return load_recipe(
        RECIPE,
        [
            "seed=1",
            "data.synthetic=null",
            f"data.path={data_path}",
            *([f"model.path={model_path}", "model.builtin=null"] if model_path else []),
            "rollout.function=tool_loop",
            "rollout.tools=[" + ",".join(f"user_tools:{name}" for name, _ in CALLS) + "]",
            f"rollout.tool_timeout_s={TIMEOUT_S}",
            f"rollout.tool_output_max_chars={OUTPUT_CAP}",
            "rollout.tool_workers=2",
            "rollout.tool_schemas_in_prompt=false",
            "rollout.max_turns=2",
            "rollout.temperature=0.05",
            "rollout.prompts_per_step=1",
            "rollout.n=2",
            "rollout.max_new_tokens=256",
            "rollout.max_trajectory_tokens=1024",
            "rollout.kv_cache_tokens=8192",
            "trainer.updates_per_rollout=1",
        ],
    )


def demonstrated_messages() -> list[dict]:
    """The conversation the model is taught; the tool messages' contents are placeholders (the
    model only has to learn its own turns)."""
    calls = [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in CALLS
    ]
    return [
        {"role": "assistant", "content": "", "tool_calls": calls},
        *({"role": "tool", "name": name, "content": "ok"} for name, _ in CALLS),
        {"role": "assistant", "content": ANSWER},
    ]


def teach(base: Path, out: Path, problem: Problem, tok) -> list[int]:
    """Overfit the base model on the demonstrated conversation (loss on the model's turns);
    returns the tokens of its first turn, which greedy decoding must now reproduce."""
    demo = tool_loop.demonstration(tok, problem, demonstrated_messages(), None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    ids = torch.tensor([demo.token_ids])
    # loss_mask covers the tokens after the prompt; token i is predicted at position i - 1
    full = [0] * demo.prompt_len + list(demo.loss_mask)
    mask = torch.tensor(full[1:], dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(300):
        logp = torch.log_softmax(model(ids).logits[0, :-1], -1)
        nll = -logp.gather(1, ids[0, 1:, None])[:, 0]
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 3e-3:  # near-deterministic at the rollout's temperature
            break
    model.save_pretrained(out)
    copy_model_files(base, out)
    first_turn_len = demo.loss_mask.index(0)
    return list(demo.token_ids[demo.prompt_len : demo.prompt_len + first_turn_len])


@pytest.fixture(scope="module")
def setup(ray_local, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("misbehaving_tools")
    data = tmp / "data.jsonl"
    data.write_text(json.dumps({"prompt": PROMPT, "answer": ANSWER}) + "\n")
    base_recipe = recipe(data)
    base = base_model_dir(base_recipe.model, base_recipe.seed)
    tok = load_tokenizer(base)
    problem = Problem(PROMPT, tok.encode_prompt(PROMPT, True), ANSWER)
    first_turn = teach(base, tmp / "model", problem, tok)
    r = recipe(data, tmp / "model")
    cfg = engine_config(r, str(tmp / "model"))
    actors = [EngineWorker.options(num_cpus=0).remote(cfg, 1) for _ in range(2)]
    ray.get([a.ready.remote() for a in actors])
    source = PromptSource(r.data, tok, seed=r.seed, max_prompt_tokens=64)
    rm = RolloutManager(
        r,
        actors,
        tok,
        resolve_reward(r.reward.function),
        source,
        rollout_fn=resolve_rollout_function("tool_loop"),
        context_len=512,  # the built-in model's max_model_len
        vocab_size=tok.vocab_size,
    )
    yield rm, tok, first_turn
    rm.close()
    for a in actors:
        ray.kill(a)


def test_hanging_crashing_flooding_tools_never_stall_a_rollout(setup):
    rm, tok, first_turn = setup
    for step in range(2):  # the second step runs on the workers that replaced the dead ones
        start = time.monotonic()
        rollout = rm.finish(rm.launch(step))
        elapsed = time.monotonic() - start
        print(f"step {step}: {elapsed:.1f} s")
        # two trajectories' hangs (2 s each) and four worker restarts; an hour's sleep
        # or a dead worker's lost reply would stall far past this
        assert elapsed < 120, f"step {step}: the rollout took {elapsed:.0f} s"
        trajectories = [t for g in rollout.groups for t in g.trajectories]
        assert len(trajectories) == 2
        for t in trajectories:
            response = list(t.token_ids[t.prompt_len :])
            assert response[: len(first_turn)] == first_turn, "the model did not make the calls"
            m = t.metrics
            assert m["tool_calls"] == 4.0
            assert (m["tool_errors_timeout"], m["tool_errors_crashed"]) == (1.0, 1.0)
            assert m["tool_errors_flood"] == 1.0 and m["tool_errors"] == 3.0
            appended = tok.tok.decode([x for x, keep in zip(response, t.loss_mask) if not keep])
            assert "hang timed out" in appended and "exit_hard crashed" in appended
            assert f"over the {OUTPUT_CAP} limit" in appended
            assert "5.0" in appended  # add's real result, computed beside the misbehaving calls
        assert rollout.metrics["tool_errors"] == 6.0
