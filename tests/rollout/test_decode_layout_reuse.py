"""`ModelRunner._decode_metadata` reuses the last step's decode layout (groups, prefixes, grid <->
batch maps) while the same sequences decode one query each. Every step of runs that share
prefixes, finish at different lengths, speculate and preempt, the metadata it used must equal a
layout computed afresh for that step."""

from __future__ import annotations

import pytest
import torch

from rollout import Engine, EngineConfig, SamplingParams
from rollout.model_runner import ModelRunner
from rollout.suffix_lanes import SuffixLanes

from tiny_hf import make_hf_model, save_hf_model


@pytest.mark.parametrize("speculative, kv_tokens", [(None, 4096), ("ngram", 4096), (None, 160)])
def test_reused_layouts_equal_fresh_ones(tmp_path, monkeypatch, speculative, kv_tokens):
    save_hf_model(make_hf_model("qwen2", seed=0), tmp_path)
    plans, checked, reused = [], [0], [0]
    plan = SuffixLanes.plan

    def recording_plan(self, seqs, drafting=True):
        plans.append(result := plan(self, seqs, drafting))
        return result

    build, decode_metadata = ModelRunner._layout, ModelRunner._decode_metadata

    def counting_layout(self, *args):
        reused[0] -= 1
        return build(self, *args)

    def compared(self, batch_seqs, drafting):
        plans.clear()
        reused[0] += 1
        meta = decode_metadata(self, batch_seqs, drafting)
        order = plans[0].order if plans and plans[0] is not None else range(len(batch_seqs))
        fresh = build(self, batch_seqs, [batch_seqs[i] for i in order], order, True)
        for name in ("prefix_pages", "prefix_bias", "member_index", "query_index", "token_cell"):
            assert torch.equal(getattr(meta, name), getattr(fresh, name)), name
        assert (meta.group_size, meta.members_in_order) == (
            fresh.group_size,
            fresh.members_in_order,
        )
        if meta.prefix_key is not None:
            assert meta.prefix_key == fresh.prefix_key
        checked[0] += 1
        return meta

    monkeypatch.setattr(SuffixLanes, "plan", recording_plan)
    monkeypatch.setattr(ModelRunner, "_layout", counting_layout)
    monkeypatch.setattr(ModelRunner, "_decode_metadata", compared)
    engine = Engine(
        EngineConfig(
            model_path=str(tmp_path),
            kv_cache_tokens=kv_tokens,
            page_size=4,
            seed=0,
            speculative_method=speculative,
        )
    )
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 60, (n,), generator=g).tolist() for n in (9, 17, 5, 30)]
    params = [
        SamplingParams(n=3, temperature=1.0, max_new_tokens=m, ignore_eos=True)
        for m in (12, 30, 7, 21)
    ]
    engine.generate(prompts, params)
    engine.check_integrity()
    assert checked[0] > 20
    # steps that took the reused layout (and were compared above); drafts make most steps
    # multi-query, which never reuse one
    assert reused[0] > (0 if speculative else 5)
    if kv_tokens < 1000:
        assert engine.stats()["preemptions"] > 0
