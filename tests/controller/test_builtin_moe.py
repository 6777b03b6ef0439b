"""The built-in mixture of experts (`model.builtin: tiny-qwen3-moe`): materialized like the other
built-ins (config.json + model.safetensors with HF names + the character tokenizer), it is a
`Qwen3MoeForCausalLM` to transformers, and the engine on it equals HF: log-probs within 1e-5 and
routes the top-k of HF's router logits, on a prompt of the built-in tokenizer."""

from __future__ import annotations

import json

import torch

from miles_like.models import store as model_store
from miles_like.models.tokenizer import load_tokenizer
from miles_like.recipe.sections import ModelSection
from rollout import Engine, EngineConfig, SamplingParams


def test_tiny_qwen3_moe_builds_and_the_engine_on_it_equals_hf(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("MILES_LIKE_CACHE", str(tmp_path))
    directory = model_store.base_model_dir(ModelSection(builtin="tiny-qwen3-moe"), seed=0)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == 8
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(directory), experts_implementation="eager"
    ).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"

    prompt = load_tokenizer(directory).encode_prompt("12+34=", chat_template=True)
    engine = Engine(EngineConfig(model_path=str(directory), kv_cache_tokens=256, page_size=4))
    params = SamplingParams(temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=3)
    rid = engine.add_request(prompt, params)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = [o for o in outs if o.request_id == rid]
    sample, routes = out.samples[0], out.routed_experts[0]
    ids = prompt + sample.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_router_logits=True)
    logits = ref.logits[0, len(prompt) - 1 : -1].double()
    logprobs = torch.log_softmax(logits, -1).gather(-1, torch.tensor(sample.token_ids)[:, None])
    torch.testing.assert_close(
        torch.tensor(sample.logprobs, dtype=torch.float64), logprobs[:, 0], atol=1e-5, rtol=0
    )
    router = torch.stack(ref.router_logits, dim=1)[: len(ids) - 1]  # [T, layers, experts]
    assert torch.equal(routes.long(), router.topk(2, dim=-1).indices)
