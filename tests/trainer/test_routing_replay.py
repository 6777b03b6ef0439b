"""Routing replay in the megatron trainer (`trainer.routing_replay`) on a tiny Qwen3-MoE (sparse
layers 0 and 2 around a dense one, so the last layer's router runs on the read rows only), the
fixed batch with a prompt shared by two samples and several micro-batches.

The reference is HF's `Qwen3MoeForCausalLM` in float64 with its router's top-k forced to the
given experts (gate weights: HF's own softmax at them, renormalised as HF does), the experts
HF's own; its unforced top-k gives the trainer's own routes."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from exact_float64 import exact_float64

import scenarios
from tiny_hf import make_hf_model, save_hf_model


def _forced_route(router, hidden_states):
    """HF's router (float64, as `exact_float64`'s) with its top-k replaced by `router.forced`
    on the rows it covers; records its own top-k in `router.own`."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = torch.nn.functional.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float64)
    top, own = torch.topk(probs, router.top_k, dim=-1)
    router.own = own
    indices = own.clone()
    if router.forced is not None:
        indices[: len(router.forced)] = router.forced
        top = probs.gather(1, indices)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), indices


class ForcedHF:
    def __init__(self, hf, sparse_layers):
        self.model = exact_float64(hf)
        self.routers = [hf.model.layers[i].mlp.gate for i in sparse_layers]
        for r in self.routers:
            r.forward = types.MethodType(_forced_route, r)
            r.forced = None

    def run(self, tokens, prompt_lens, routes=None):
        """Response log-probs per sample and the router's own routes [n - 1, layers, k]."""
        lps, own = [], []
        with torch.no_grad():
            for i, (seq, p) in enumerate(zip(tokens, prompt_lens)):
                for j, r in enumerate(self.routers):
                    r.forced = None if routes is None else routes[i][:, j].long()
                logp = torch.log_softmax(self.model(torch.tensor([seq])).logits[0], dim=-1)
                lps.append(logp[torch.arange(p - 1, len(seq) - 1), torch.tensor(seq[p:])])
                own.append(torch.stack([r.own[:-1] for r in self.routers], 1).to(torch.uint8))
        return lps, own


@pytest.fixture(scope="module")
def moe64(tmp_path_factory):
    from model_spec import ModelSpec

    hf = make_hf_model("qwen3_moe", dtype=torch.float64)
    directory = save_hf_model(hf, tmp_path_factory.mktemp("moe64"))
    arch = ModelSpec.from_dir(directory)
    return directory, ForcedHF(hf, arch.moe.sparse_layers), arch


def _changed_routes(own, batch, num_experts):
    """`own` with a different top-k set in the last sparse layer at response rows q
    (p <= q <= n - 2) where q + i is even: rows the last layer's router sees (the read rows;
    sample 3's prompt rows are sample 0's in the packed layout, so none of them is changed),
    and no router runs after it, so every other set the trainer's router picks stays its own."""
    routes, changed = [], 0
    for i, r in enumerate(own):
        r = r.clone()
        n, p = len(batch.tokens[i]), batch.prompt_lens[i]
        for q in range(p, n - 1):
            if (q + i) % 2 == 0:
                # k distinct experts, another set
                r[q, -1] = ((r[q, -1].long() + 1) % num_experts).to(r.dtype)
                changed += 1
        routes.append(r)
    return routes, changed


def test_replay_of_own_routes_changes_nothing_and_other_routes_match_forced_hf(moe64):
    from trainer.megatron_trainer import MegatronTrainer

    directory, hf, arch = moe64
    cfg = scenarios.trainer_config(directory, dtype="float64")
    # lr 0: the step leaves the weights alone, so its agreement is against the same router
    cfg = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=0.0))
    trainer = MegatronTrainer(cfg)
    batch = scenarios.fixed_batch(arch.vocab_size)
    assert batch.tokens[3][:3] == batch.tokens[0][:3]  # a shared prompt is packed once

    free = trainer.compute_logprobs(batch)
    reference_free, own = hf.run(batch.tokens, batch.prompt_lens)
    assert max(float((a - b).abs().max()) for a, b in zip(free, reference_free)) <= 1e-10

    # (1) the trainer's own routes: bitwise the free forward, agreement exactly 1
    with_own = dataclasses.replace(batch, routed_experts=own)
    for a, b in zip(trainer.compute_logprobs(with_own), free):
        assert torch.equal(a, b)
    assert trainer.train_step(with_own)["routing_agreement"] == 1.0

    # (2) other routes: HF forced to them, and the share of sets changed
    routes, changed = _changed_routes(own, batch, arch.moe.num_experts)
    forced = dataclasses.replace(batch, routed_experts=routes)
    got = trainer.compute_logprobs(forced)
    want, _ = hf.run(batch.tokens, batch.prompt_lens, routes)
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) <= 1e-10
    assert max(float((a - b).abs().max()) for a, b in zip(got, free)) > 1e-6  # routes matter
    # (token, sparse layer) sets replayed: layer 0 routes every packed row with a route (each
    # sample's n - 1, sample 3's shared prompt once); the last layer only the read rows (each
    # sample's n - p, the shared prompt's last row once)
    n = [len(t) for t in batch.tokens]
    p = batch.prompt_lens
    rows_first = sum(k - 1 for k in n) - p[3]
    rows_last = sum(a - b for a, b in zip(n, p)) - 1
    expected = 1 - changed / (rows_first + rows_last)
    agreement = trainer.train_step(forced)["routing_agreement"]
    assert 0 < agreement < 1 and agreement == pytest.approx(expected, abs=1e-15)


def test_router_gradients_under_replay_equal_forced_hf(moe64):
    """float64, PPO on policy (ratio 1, token-mean, no entropy / KL / clipping of the grad
    norm): the gradient the step leaves on every sparse layer's router weight under replayed
    routes equals HF's gradient of -sum(advantage * log-prob) / tokens with its router forced
    to the same routes (the gate weights are the router's only path to the loss)."""
    from trainer.config import LossConfig, OptimConfig
    from trainer.megatron_trainer import MegatronTrainer

    directory, hf, arch = moe64
    trainer = MegatronTrainer(
        scenarios.trainer_config(
            directory,
            dtype="float64",
            optim=OptimConfig(lr=1e-3, eps=1e-3, grad_clip=None, weight_decay=0.0),
            loss=LossConfig(policy_loss="ppo"),
        )
    )
    batch = scenarios.fixed_batch(arch.vocab_size)
    batch = dataclasses.replace(batch, advantages=[a.double() for a in batch.advantages])
    _, own = hf.run(batch.tokens, batch.prompt_lens)
    routes, _ = _changed_routes(own, batch, arch.moe.num_experts)
    metrics = trainer.train_step(dataclasses.replace(batch, routed_experts=routes))
    assert metrics["routing_agreement"] < 1

    hf.model.zero_grad()
    total = sum(a.numel() for a in batch.advantages)
    for i, (seq, p) in enumerate(zip(batch.tokens, batch.prompt_lens)):
        for j, r in enumerate(hf.routers):
            r.forced = routes[i][:, j].long()
        logp = torch.log_softmax(hf.model(torch.tensor([seq])).logits[0], dim=-1)
        lp = logp[torch.arange(p - 1, len(seq) - 1), torch.tensor(seq[p:])]
        (-(batch.advantages[i] * lp).sum() / total).backward()
    params = dict(trainer.policy.raw.named_parameters())
    for j, layer in enumerate(arch.moe.sparse_layers):
        want = hf.routers[j].weight.grad
        got = params[f"decoder.layers.{layer}.mlp.router.weight"].main_grad
        assert float(want.abs().max()) > 1e-3
        assert float((got - want).abs().max()) <= 1e-10, layer


def test_routes_that_do_not_fit_the_tokens_are_one_clear_line():
    batch = scenarios.fixed_batch(64)
    bad = [torch.zeros(len(t) - 2, 2, 2, dtype=torch.uint8) for t in batch.tokens]
    with pytest.raises(ValueError, match=r"batch.routed_experts\[0\] has shape \(7, 2, 2\)"):
        dataclasses.replace(batch, routed_experts=bad)


def test_routes_for_a_model_that_cannot_replay_them_are_refused(tiny_hf_checkpoints):
    """A dense model has no router: routes given to it are refused in one line by either
    backend, never silently ignored."""
    from trainer.deepspeed_trainer import DeepSpeedTrainer
    from trainer.megatron_trainer import MegatronTrainer

    hf, directory = tiny_hf_checkpoints("qwen3")
    batch = scenarios.fixed_batch(hf.config.vocab_size)
    routes = [torch.zeros(len(t) - 1, 2, 2, dtype=torch.uint8) for t in batch.tokens]
    batch = dataclasses.replace(batch, routed_experts=routes)
    megatron = MegatronTrainer(scenarios.trainer_config(directory))
    with pytest.raises(ValueError, match="routed_experts given for a dense model"):
        megatron.compute_logprobs(batch)
    deepspeed = DeepSpeedTrainer(scenarios.trainer_config(directory, backend="deepspeed"))
    with pytest.raises(ValueError, match="routed_experts given for a dense model"):
        deepspeed.train_step(batch)
    with pytest.raises(ValueError, match="routed_experts given for a dense model"):
        deepspeed.compute_logprobs(batch)
