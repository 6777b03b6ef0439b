"""Streaming scoring (`oversampling.OverSampledRollout`) on a real `EngineWorker` actor.

A long-tailed rollout: 7 groups of 4 tokens and one of 480 (`ignore_eos`, per-group
`max_new_tokens`), n = 2, a reward taking SLOW_S per call on one reward worker. Each group is
scored as soon as its samples are done, so the scoring of the short groups runs while the long
one still decodes:

* exact: the rollout's groups (trajectories, scores, shaped rewards) equal scoring the same
  trajectories at the end (`GroupScorer.groups`, the non-streaming path);
* overlapped: every short group's scoring has finished before the long group's starts, so
  it ran while the long group still decoded (scoring at the end would start them together).
  This is an order of events, not a wall-time bound: a loaded box slows the decoding, which
  only widens the window the short groups' scoring must fit in.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from miles_like.data import Problem
from miles_like.models.tokenizer import HFTokenizer
from miles_like.recipe import load_recipe
from miles_like.rollouts.group_scoring import GroupScorer
from miles_like.rollouts.oversampling import OverSampledRollout
from miles_like.rollouts.partial import OpenGroup
from miles_like.rollouts.replica_batcher import ReplicaBatcher
from miles_like.scoring.rewards import compute_rewards, exact_match
from rollout import EngineConfig, SamplingParams

from tiny_hf import make_hf_model, save_bpe_tokenizer, save_hf_model
from user_rewards import SLOW_EXACT_S as SLOW
from user_rewards import slow_exact_match as slow_exact

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = [4, 4, 4, 960, 4, 4, 4, 4]  # the long group outlasts the short ones' scoring
N = 2


def test_streamed_scores_equal_scoring_at_the_end_and_overlap_generation(
    ray_local, tmp_path, monkeypatch
):
    from miles_like.run.engine_worker import EngineWorker

    tok = save_bpe_tokenizer(tmp_path, ["one two three four five six"] * 20, vocab_size=280)
    save_hf_model(
        make_hf_model("qwen2", vocab_size=len(tok), max_position_embeddings=1024), tmp_path
    )
    worker = EngineWorker.remote(
        EngineConfig(
            model_path=str(tmp_path), kv_cache_tokens=4096, page_size=4, max_model_len=1024
        ),
        1,
    )
    recipe = load_recipe(
        ROOT / "recipes" / "tiny_arith_grpo.yaml",
        [
            f"rollout.prompts_per_step={len(LENGTHS)}",
            f"rollout.n={N}",
            "rollout.max_new_tokens=160",
            "rollout.stream_scoring=true",
            "reward.max_workers=1",
        ],
        check_paths_exist=False,
    )
    problems = [Problem(f"p{g}", [3 + g, 5, 7, 9, 11], "one") for g in range(len(LENGTHS))]
    params = [
        SamplingParams(n=N, max_new_tokens=k, seed=10 * g, ignore_eos=True)
        for g, k in enumerate(LENGTHS)
    ]

    def rollout(reward_fn):
        scorer = GroupScorer(recipe, reward_fn, HFTokenizer.load(tmp_path).tok)
        groups = [OpenGroup(p, ()) for p in problems]
        batcher = ReplicaBatcher([worker], 300.0)
        start = time.perf_counter()
        out = asyncio.run(
            OverSampledRollout(recipe, [worker], scorer, groups, params, batcher).run()
        )
        return out, time.perf_counter() - start

    for fn in (exact_match, slow_exact):  # start both reward pools (one per function) first
        assert compute_rewards(fn, ["p"], ["one"], ["one"], max_workers=1).scores == [1.0]
    rollout(exact_match)  # the actor's start and first steps

    scoring = {}  # prompt -> (start, end) of its group's scoring, on the rollout's threads
    score_open_group = GroupScorer.open_group

    def timed_score_open_group(scorer, group):
        start = time.perf_counter()
        out = score_open_group(scorer, group)
        scoring[group.problem.prompt] = (start, time.perf_counter())
        return out

    monkeypatch.setattr(GroupScorer, "open_group", timed_score_open_group)
    t0 = time.perf_counter()
    streamed, wall_s = rollout(slow_exact)

    at_end, counts = GroupScorer(recipe, slow_exact).groups(
        problems, [g.trajectories for g in streamed.batch]
    )
    assert streamed.batch == at_end
    assert [len(t.token_ids) - t.prompt_len for g in at_end for t in g.trajectories] == [
        k for k in LENGTHS for _ in range(N)
    ]
    assert counts["reward_errors"] == 0 and streamed.tallies["reward_errors"] == 0
    long_id = problems[LENGTHS.index(max(LENGTHS))].prompt
    long_start = scoring[long_id][0]
    short_ends = [end for pid, (_, end) in scoring.items() if pid != long_id]
    print(
        f"rollout {wall_s:.2f} s: the short groups scored by {max(short_ends) - t0:.2f} s, "
        f"the long group's scoring began at {long_start - t0:.2f} s"
    )
    assert len(scoring) == len(LENGTHS)
    assert long_start - t0 > (len(LENGTHS) - 1) * N * SLOW  # so the order below can show overlap
    assert max(short_ends) < long_start, "the short groups were not scored during generation"
