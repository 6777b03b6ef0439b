"""`rollout.partial: in_place` in fully asynchronous training (`rollouts/async_producer/`), end
to end on Ray (float64, one engine, one trainer, responses long enough to run across updates).

* The weight updates keep the running requests and their K/V: some trained sample has tokens
  of two weight versions in one engine result (no abort, no second request), the K/V kept
  across updates is counted (`rollout/in_place_reused_tokens` > 0), the behaviour log-probs the
  trainer's importance correction (TIS) gets are exactly the ones the engine returned, and no
  trained group is staler than `cluster.max_staleness`; every drawn prompt is trained,
  dropped or held once.
* Kill -9 at an arbitrary moment, resume with checkpoint.resume=auto: the prompt accounting
  stays exact over the finished run; the groups open at the checkpoint continue on fresh
  engines without their parked K/V, as retract does (nothing reused in the first resumed
  window). The killed run holds one group open at every checkpoint (`held_open_train.py`), so
  the checkpoint resumed from always has an open group with tokens, whatever the engine's lead.
"""

from __future__ import annotations

import json
from collections import defaultdict

import pytest
from killed_run import killed_run
from test_async_e2e import ASYNC, BASE, LONG, PROMPTS, check_accounting, run_in_process
from test_resume_e2e import RECIPE

from miles_like.rollouts.async_producer.sending import Sender
from miles_like.run import checkpoint
from miles_like.run.actors import RunActors

pytestmark = pytest.mark.slow

IN_PLACE = (*ASYNC, *LONG, "rollout.partial=in_place", "cluster.max_staleness=1")
REUSED = "rollout/in_place_reused_tokens"


def test_updates_keep_running_requests_and_their_kv(ray_local, cache, tmp_path, monkeypatch):
    # what the engines returned, per (prompt index, sample): each result's tokens, log-probs
    # and per-token versions, in order; and what the trainer was given
    returned: dict[tuple, list] = defaultdict(list)
    deliver = Sender.deliver

    def recording_deliver(self, owner, samples, version, versions, replica):
        i, js = owner
        if i in self.ledger.open:  # (a group dropped while its requests ran is not trained)
            prompt = tuple(self.ledger.open[i].group.problem.prompt_ids)
            for k, (j, s) in enumerate(zip(js, samples)):
                returned[prompt, i, j].append(
                    (list(s.token_ids), list(s.logprobs), list(versions[k]))
                )
        return deliver(self, owner, samples, version, versions, replica)

    trained: list[tuple[list[int], int, list[float]]] = []
    start_train = RunActors.start_train  # every train call starts here (either loop)

    def recording_start_train(self, batch):
        for tokens, start, lp in zip(batch.tokens, batch.prompt_lens, batch.rollout_logprobs):
            trained.append((list(tokens), start, lp.tolist()))
        return start_train(self, batch)

    monkeypatch.setattr(Sender, "deliver", recording_deliver)
    monkeypatch.setattr(RunActors, "start_train", recording_start_train)
    rows = run_in_process(
        tmp_path / "in_place",
        "steps=6",
        "checkpoint.every_steps=0",
        "algorithm.is_correction=tis",
        *IN_PLACE,
    )
    assert len(rows) == 6
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    assert sum(r[REUSED] for r in rows) > 0
    assert sum(r["rollout/continued_groups"] for r in rows) > 0
    assert all(r["train/grad_norm"] > 0 for r in rows)
    assert len(check_accounting(rows)) == 6 * PROMPTS

    # each sample as the engine returned it: its results' tokens, log-probs and versions joined
    # (keyed by prompt + response; two equal samples of one prompt are both candidates)
    by_tokens = defaultdict(list)
    for (prompt, _, _), results in returned.items():
        response = tuple(t for r in results for t in r[0])
        by_tokens[prompt + response].append(
            (
                [x for r in results for x in r[1]],
                [v for r in results for v in r[2]],
                len(results),
            )
        )
    straddled = 0
    for tokens, start, lp in trained:
        # bitwise: the behaviour policy TIS corrects for is the engine's own numbers
        matches = [m for m in by_tokens[tuple(tokens)] if m[0] == lp]
        assert matches, "a trained sample's log-probs are not what the engine returned"
        logprobs, versions, results = matches[0]
        assert len(versions) == len(tokens) - start
        # one engine result sampled by two versions: the update landed while it ran
        straddled += results == 1 and len(set(versions)) == 2
    assert straddled > 0


STEPS = 12
DELAY_S = 0.3  # after checkpoint 3: inside step 3 or later, not at a checkpoint


def test_killed_in_place_run_resumes_as_retract(ray_local, cache, tmp_path):
    out = tmp_path / "killed"
    overrides = (
        f"steps={STEPS}",
        "checkpoint.every_steps=3",
        "checkpoint.keep_last=100",
        # the default capacity (prompts_per_step x (max_staleness + 1)), and a room for the group
        # the killed run keeps back for each checkpoint (`held_open_train.py`)
        f"cluster.async_buffer_groups={2 * PROMPTS + 1}",
    )
    marker = out / "checkpoints" / "step_000003" / "state.json"
    args = [RECIPE, *BASE, *overrides, *IN_PLACE]
    with killed_run(out, args, marker, delay_s=DELAY_S, module="held_open_train") as kill:
        pass
    assert kill.rows_at_kill and 3 <= kill.rows_at_kill[0] < STEPS, "not killed mid-run"
    resumed_from = checkpoint.complete_checkpoints(out)[-1]
    state = json.loads((resumed_from / "state.json").read_text())
    first = state["next_step"]
    rows = run_in_process(out, *overrides, *IN_PLACE, "checkpoint.resume=auto")
    assert [r["step"] for r in rows] == list(range(STEPS))
    trained = check_accounting(rows)
    assert len(trained) == STEPS * PROMPTS
    assert all(r["rollout/staleness_max"] <= 1 for r in rows)
    # the checkpoint held open groups with their tokens (the killed run holds one open at every
    # checkpoint), all sampled by the weights its update replaced (older ones are stale); on the
    # fresh engines they prefilled again: nothing was reused in the first resumed window, and
    # the engines reused K/V again after the first update
    partial = [g for g in state["async"]["open"] if any(s["token_ids"] for s in g["samples"])]
    assert partial
    assert all(
        len(s["token_ids"]) == len(s["logprobs"]) == len(s["versions"])
        and set(s["versions"]) <= {state["weight_version"] - 1}
        for g in partial
        for s in g["samples"]
    )
    assert rows[first][REUSED] == 0
    assert any(r[REUSED] > 0 for r in rows[first + 1 :])
