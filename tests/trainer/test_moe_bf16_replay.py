"""Why routing replay: a mixture whose top-k choices are near ties (its routers' weights scaled
down, so the router logits of a token lie close together), sampled by the engine and scored by
the megatron trainer, both in bfloat16. The two compute the same function with different
roundings, so some top-k sets differ: replaying the engine's routes (`RequestOutput.
routed_experts`, the trainer's gate weights from its own logits) brings the trainer's
log-probs closer to the engine's. Measured on the engine's own samples: the trainer's routing
agreement with the engine is below 1, and the mismatch KL (`mismatch_kl`, the k3 estimate of
KL(engine || trainer)) is higher with replay off than on."""

from __future__ import annotations

import dataclasses

import torch

import scenarios
from tiny_hf import make_hf_model, save_hf_model

ROUTER_SCALE = 0.05  # router logits 20 times closer together: many near ties
PROMPTS = [[3 + i, 17, 5 + 2 * i, 40 - i, 9] for i in range(8)]


def test_replay_lowers_the_bf16_mismatch_of_a_near_tie_mixture(tmp_path):
    from rollout import Engine, EngineConfig, SamplingParams
    from trainer.config import RLBatch
    from trainer.megatron_trainer import MegatronTrainer

    hf = make_hf_model("qwen3_moe")
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.mul_(ROUTER_SCALE)
    directory = save_hf_model(hf, tmp_path / "hf")
    engine = Engine(EngineConfig(model_path=str(directory), dtype="bfloat16", kv_cache_tokens=1024))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=24, ignore_eos=True, seed=5)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step())
    tokens, prompt_lens, logprobs, routes = [], [], [], []
    for rid, prompt in zip(ids, PROMPTS):
        out = done[rid]
        for sample, r in zip(out.samples, out.routed_experts):
            tokens.append(prompt + sample.token_ids)
            prompt_lens.append(len(prompt))
            logprobs.append(torch.tensor(sample.logprobs, dtype=torch.float32))
            routes.append(r)
    batch = RLBatch(
        tokens=tokens,
        prompt_lens=prompt_lens,
        advantages=[torch.zeros(len(lp)) for lp in logprobs],
        rollout_logprobs=logprobs,
    )
    cfg = scenarios.trainer_config(directory, dtype="bfloat16", max_tokens_per_micro_batch=4096)
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.0))
    trainer = MegatronTrainer(cfg)
    off = trainer.train_step(batch)
    on = trainer.train_step(dataclasses.replace(batch, routed_experts=routes))
    print(
        f"bf16 near-tie mixture: routing agreement {on['routing_agreement']:.4f}, mismatch KL "
        f"replay off {off['mismatch_kl']:.3e}, on {on['mismatch_kl']:.3e}"
    )
    assert on["routing_agreement"] < 1
    assert off["mismatch_kl"] > on["mismatch_kl"]
