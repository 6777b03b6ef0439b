"""One name per concept: the engine and trainer configs take the recipe's words (`tp`, `pp`,
`kl_type`, `loss_agg`, `policy_loss`). Their former names are still accepted for one release,
each with a one-line DeprecationWarning naming the new field, and give the same config."""

from __future__ import annotations

import pytest

from rollout.config import EngineConfig
from trainer.config import LossConfig, TrainerConfig


@pytest.mark.parametrize(
    "make, old, new, value",
    [
        (lambda **kw: EngineConfig(model_path="m", **kw), "tensor_parallel_size", "tp", 2),
        (lambda **kw: TrainerConfig(model_path="m", **kw), "tensor_model_parallel_size", "tp", 2),
        (lambda **kw: TrainerConfig(model_path="m", **kw), "pipeline_model_parallel_size", "pp", 2),
        (LossConfig, "kl_kind", "kl_type", "k3"),
        (LossConfig, "agg_mode", "loss_agg", "seq-mean"),
    ],
)
def test_former_name_warns_once_and_builds_the_same_config(make, old, new, value):
    with pytest.warns(DeprecationWarning) as caught:
        before = make(**{old: value})
    (warning,) = caught
    message = str(warning.message)
    assert message.startswith(f"{type(before).__name__}.{old} is deprecated; write ")
    assert f".{new} instead" in message and "\n" not in message
    assert before == make(**{new: value})
    with pytest.raises(ValueError, match=f"former name of {type(before).__name__}.{new}"):
        make(**{old: value, new: value})
