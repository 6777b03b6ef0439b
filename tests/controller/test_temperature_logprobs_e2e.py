"""Engine and trainer log-probs agree at a temperature != 1, end to end (float64 recipe, dense).

Both sides compute log_softmax(logits / T) with T the recipe's own number: the engine in its
sampler (`rollout.sampler`), the trainer in its loss. On the same weights (a synchronous run)
they agree to rounding, so `train/logprob_diff_max` stays at float64 rounding; a float32 rounding
of T on either side (a relative error ~1e-8) puts it near 1e-8.
"""

from __future__ import annotations

import pytest
from test_resume_e2e import COMMON, RECIPE, rows_of

from miles_like.recipe.cli import main
from miles_like.run.loop import run

pytestmark = pytest.mark.slow


def test_engine_and_trainer_logprobs_agree_at_temperature_0_8(ray_local, cache, tmp_path):
    out = tmp_path / "run"
    overrides = ("steps=2", "checkpoint.every_steps=0", "rollout.temperature=0.8")
    assert main([RECIPE, f"tracking.output_dir={out}", *COMMON, *overrides], run=run) == 0
    rows = rows_of(out)
    assert len(rows) == 2
    for r in rows:
        assert r["train/logprob_diff_max"] <= 1e-10, r["train/logprob_diff_max"]
