"""A mixture of experts in the megatron trainer at TP = 2 over gloo (2 processes,
`moe_tp_scenario.py`): tokens replicated over TP (no sequence parallelism), each expert split
over TP like the dense MLP, its partial outputs summed once per layer
(`megatron_moe.ReplicatedTokensDispatcher`). Against references computed here:

* the forward equals HF's `Qwen3MoeForCausalLM` / `Qwen2MoeForCausalLM` within 1e-10 in float64
  (HF made float64 throughout by `exact_float64`), top-k renormalised and not;
* the export gives back the checkpoint bitwise;
* one PPO step with the load-balancing loss on equals the same step at TP = 1 in this process
  (weights after the step within 1e-10, loss, grad norm and `moe_aux_loss` within 1e-10
  relative): no expert gradient counted TP times, the router's gradient whole;
* each trainer TP rank's engine shards are bitwise the layout rules' slices of the trained
  weights (`tp_slices.py`: the resharding sync's expert shards, gate / up by rows, down by
  columns, the router whole).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from exact_float64 import exact_float64
from safetensors.torch import load_file

import scenarios
from tiny_hf import make_hf_model, save_hf_model
from trainer_helpers import torchrun

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "controller"))
from tp_slices import expected_slice  # noqa: E402

pytestmark = pytest.mark.slow

CASES = {
    "qwen3_moe-renorm": ("qwen3_moe", True),
    "qwen3_moe": ("qwen3_moe", False),
    "qwen2_moe": ("qwen2_moe", False),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for case, (family, norm) in CASES.items():
        hf = make_hf_model(family, dtype=torch.float64, norm_topk_prob=norm)
        out[case] = (hf, save_hf_model(hf, tmp_path_factory.mktemp(case)))
    return out


@pytest.fixture(scope="module")
def tp2(checkpoints, tmp_path_factory):
    out = tmp_path_factory.mktemp("moe_tp2") / "results.pt"
    dirs = {case: str(directory) for case, (_, directory) in checkpoints.items()}
    torchrun(HERE / "moe_tp_scenario.py", [str(out), json.dumps(dirs)], timeout=500)
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("case", CASES)
def test_tp2_forward_equals_hf_and_export_round_trips(case, checkpoints, tp2):
    from moe_tp_scenario import forward_ids

    hf, directory = checkpoints[case]
    ids = forward_ids(hf.config.vocab_size)
    with torch.no_grad():
        want = exact_float64(hf)(ids).logits
    assert float((tp2[case]["logits"] - want).abs().max()) <= 1e-10
    original = load_file(directory / "model.safetensors")
    exported = tp2[case]["exported"]
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize("case", CASES)
def test_tp2_step_equals_tp1_and_engine_shards_are_slices(case, checkpoints, tp2):
    from moe_tp_scenario import AUX

    from trainer.megatron_trainer import MegatronTrainer

    _, directory = checkpoints[case]
    one = MegatronTrainer(
        scenarios.trainer_config(directory, dtype="float64", moe_aux_loss_coeff=AUX)
    )
    before = load_file(directory / "model.safetensors")
    metrics = one.train_step(scenarios.fixed_batch(one.vocab_size))
    after = one.hf_state_dict()
    got = tp2[case]
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        assert got["metrics"][key] == pytest.approx(metrics[key], rel=1e-10, abs=1e-12), key
    assert sorted(got["after"]) == sorted(after)
    for name, tensor in after.items():
        assert float((got["after"][name] - tensor).abs().max()) <= 1e-10, name
    experts = [n for n in after if ".mlp.experts." in n]
    assert any(not torch.equal(after[n], before[n]) for n in experts)
    for rank, shards in enumerate(got["engine_shards"]):
        assert sorted(shards) == sorted(n for n in after if n != "lm_head.weight" or n in shards)
        for name in experts + [n for n in after if n.endswith("mlp.gate.weight")]:
            assert torch.equal(shards[name], expected_slice(name, got["after"][name], 2, rank)), (
                rank,
                name,
            )
