"""megatron backend, one process: log-probs equal HF transformers', export round-trips bitwise,
and the first step of a rollout has ratio exactly 1 and KL exactly 0."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors.torch import load_file

from trainer.config import LossConfig, OptimConfig, RLBatch

import scenarios
from trainer_helpers import FAMILIES, hf_response_logprobs, max_abs_diff


@pytest.mark.parametrize("family", FAMILIES)
def test_logprobs_and_entropy_equal_hf(family, tiny_hf_checkpoints, single_process_results):
    hf_model, _ = tiny_hf_checkpoints(family)
    res = single_process_results[family]
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    ref_lp, ref_ent = hf_response_logprobs(hf_model, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(res["logprobs"], ref_lp) <= 1e-5
    assert max_abs_diff(res["entropy"], ref_ent) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_export_round_trips_bitwise(family, hf_dirs, single_process_results):
    original = load_file(hf_dirs[family] / "model.safetensors")
    exported = single_process_results[family]["exported"]
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype
        assert torch.equal(exported[name], tensor), name


def test_step_changes_weights(single_process_results):
    # Guards the layout-equality tests: a step that did nothing would compare equal trivially.
    res = single_process_results["qwen2"]
    moved = max(float((res["after"][k] - res["exported"][k]).abs().max()) for k in res["after"])
    assert moved > 1e-4


def test_temperature_logprobs_equal_hf(tiny_hf_checkpoints):
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("qwen2")
    cfg = scenarios.trainer_config(directory, loss=LossConfig(temperature=0.7))
    trainer = MegatronTrainer(cfg)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    ref, _ = hf_response_logprobs(hf_model, batch.tokens, batch.prompt_lens, temperature=0.7)
    assert max_abs_diff(trainer.compute_logprobs(batch), ref) <= 1e-5


def test_first_step_ratio_one_and_kl_zero(tiny_hf_checkpoints):
    """Policy == behaviour policy == reference before the first update: the recomputed
    old log-probs equal the training forward's bitwise, so ratio is exactly 1, nothing clips,
    and every KL estimator is exactly 0."""
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("qwen3")
    cfg = scenarios.trainer_config(
        directory,
        use_reference=True,
        reference_on_cpu=True,
        loss=LossConfig(policy_loss="ppo", kl_coef=0.1, kl_type="k3", entropy_coef=0.0),
    )
    trainer = MegatronTrainer(cfg)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    metrics = trainer.train_step(batch)
    assert metrics["ratio_max"] == 1.0
    assert metrics["clipfrac"] == 0.0
    assert metrics["kl"] == 0.0
    assert abs(metrics["ratio_mean"] - 1.0) < 1e-6  # a mean of exact ones, summed in shares
    # pg_loss at ratio 1 is -token_mean(A), which we can compute by hand.
    adv = torch.cat(batch.advantages)
    assert metrics["pg_loss"] == pytest.approx(float(-adv.mean()), abs=1e-6)
    assert metrics["grad_norm"] > 0 and metrics["lr"] == cfg.optim.lr
    # After the update the policy moved away from the reference: KL becomes positive.
    second = trainer.train_step(dataclasses.replace(batch))
    assert second["kl"] > 0


def test_non_finite_loss_skips_the_update_and_keeps_the_weights(tiny_hf_checkpoints):
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("qwen2")
    trainer = MegatronTrainer(scenarios.trainer_config(directory))
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    before = trainer.hf_state_dict()
    poisoned = [a.clone() for a in batch.advantages]
    poisoned[2][1] = float("nan")
    with pytest.warns(RuntimeWarning, match="non-finite"):
        metrics = trainer.train_step(dataclasses.replace(batch, advantages=poisoned))
    assert metrics["update_skipped"] == 1.0 and not math.isfinite(metrics["grad_norm"])
    after = trainer.hf_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the next, healthy batch trains as if the bad one never happened (same LR step, moves)
    healthy = trainer.train_step(batch)
    assert healthy["update_skipped"] == 0.0 and healthy["lr"] == metrics["lr"]
    assert any(not torch.equal(before[k], v) for k, v in trainer.hf_state_dict().items())


def test_sft_steps_lower_the_loss(tiny_hf_checkpoints):
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("llama")
    cfg = scenarios.trainer_config(
        directory, loss=LossConfig(policy_loss="sft"), optim=OptimConfig(lr=3e-3, grad_clip=1.0)
    )
    trainer = MegatronTrainer(cfg)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    losses = [trainer.train_step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1, losses


def test_micro_batch_split_does_not_change_the_step(tiny_hf_checkpoints):
    """Gradient accumulation: one big micro-batch and many small ones give the same step."""
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("qwen2")
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    after = []
    for budget in (12, 1000):
        cfg = scenarios.trainer_config(
            directory,
            max_tokens_per_micro_batch=budget,
            loss=LossConfig(policy_loss="ppo", loss_agg="seq-mean", entropy_coef=0.01),
        )
        trainer = MegatronTrainer(cfg)
        trainer.train_step(batch)
        after.append(trainer.hf_state_dict())
    assert max(float((after[0][k] - after[1][k]).abs().max()) for k in after[0]) <= 1e-5


def test_offload_onload_report_bytes(tiny_hf_checkpoints):
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("qwen2")
    trainer = MegatronTrainer(scenarios.trainer_config(directory))
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    trainer.train_step(batch)  # creates Adam state
    param_bytes = sum(p.numel() * p.element_size() for p in trainer.params)
    moved = trainer.offload()
    assert moved == 3 * param_bytes  # params + exp_avg + exp_avg_sq
    assert trainer.onload() == moved
    before = trainer.hf_state_dict()
    metrics = trainer.train_step(batch)  # still trains after the round trip
    assert metrics["grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in trainer.hf_state_dict().items())


def test_batch_validation_names_the_field():
    with pytest.raises(ValueError, match="advantages"):
        RLBatch(tokens=[[1, 2, 3]], prompt_lens=[1], advantages=[torch.zeros(5)])


def test_critic_values_match_hf_hidden_states_and_learn(tiny_hf_checkpoints):
    """The critic's value of response token t is w . h, where h is HF's final (normed) hidden
    state at the position predicting t and w the value head; training reduces the value loss."""
    from trainer.critic import MegatronCritic

    hf_model, directory = tiny_hf_checkpoints("qwen2")
    critic = MegatronCritic(scenarios.trainer_config(directory, optim=OptimConfig(lr=1e-2)))
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in critic.compute_values(batch))
    returns = [torch.linspace(-1.0, 1.0, len(a)) for a in batch.advantages]
    batch = dataclasses.replace(batch, returns=returns)
    first = critic.train_step(batch)
    for _ in range(4):
        last = critic.train_step(batch)
    assert last["value_loss"] < 0.5 * first["value_loss"], (first, last)
    # Independent check of the value read-out: the trained backbone has moved away from the
    # HF weights, so put the trained (non-zero) head on a fresh critic whose backbone is HF's.
    head = critic.model.raw.output_layer.value.weight.detach().clone()
    fresh = MegatronCritic(scenarios.trainer_config(directory))
    with torch.no_grad():
        fresh.model.raw.output_layer.value.weight.copy_(head)
        for seq, p, v in zip(batch.tokens, batch.prompt_lens, fresh.compute_values(batch)):
            hidden = hf_model.model(torch.tensor([seq])).last_hidden_state[0]
            want = hidden[p - 1 : len(seq) - 1] @ head[0]
            assert float((v - want).abs().max()) <= 1e-5


def test_critic_learns_values_that_depend_on_the_response(tiny_hf_checkpoints):
    """Returns fixed by the first response token (unknown before it, R = token parity after):
    a critic that learned only the mean would explain none of their variance; ours most of it."""
    from trainer.critic import MegatronCritic, explained_variance

    _, directory = tiny_hf_checkpoints("qwen2")
    g = torch.Generator().manual_seed(1)
    tokens, returns = [], []
    for _ in range(32):
        seq = torch.randint(0, 97, (9,), generator=g).tolist()
        outcome = float(seq[5] % 2)
        tokens.append(seq)
        returns.append(torch.tensor([0.5, outcome, outcome, outcome]))
    batch = RLBatch(
        tokens=tokens, prompt_lens=[5] * 32, advantages=[torch.zeros(4)] * 32, returns=returns
    )
    critic = MegatronCritic(
        scenarios.trainer_config(directory, optim=OptimConfig(lr=1e-2)), value_clip=None
    )
    assert explained_variance(critic.compute_values(batch), returns) == 0.0  # zero head
    for _ in range(10):
        critic.train_step(batch)
    assert explained_variance(critic.compute_values(batch), returns) > 0.9


def test_unpacked_batch_forward_equals_hf(tiny_hf_checkpoints):
    """The unpacked `bshd` path of SDPACoreAttention: a [b, s] batch of equal lengths."""
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("llama")
    trainer = MegatronTrainer(scenarios.trainer_config(directory))
    ids = torch.randint(
        0, hf_model.config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(5)
    )
    pos = torch.arange(11).expand(2, 11)
    with torch.no_grad():
        got = trainer.policy.raw(ids, pos, None)[..., : hf_model.config.vocab_size]
        want = hf_model(ids).logits
    assert float((got - want).abs().max()) <= 1e-5


@pytest.mark.parametrize("mode", ["tis", "mis"])
def test_engine_logprob_correction_and_diff_metrics(mode, tiny_hf_checkpoints):
    """With engine log-probs = trainer log-probs - delta, the first step's pg_loss is
    -token_mean(A * w) with w = exp(delta) truncated (TIS) or masked (MIS) at the cap, and the
    reported engine/trainer log-prob gap is |delta|."""
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("qwen2")
    cfg = scenarios.trainer_config(
        directory,
        loss=LossConfig(policy_loss="ppo", is_correction=mode, is_cap=1.5, entropy_coef=0.0),
    )
    trainer = MegatronTrainer(cfg)
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    old = trainer.compute_logprobs(batch)
    g = torch.Generator().manual_seed(9)
    deltas = [torch.rand(len(x), generator=g) for x in old]  # w = e^delta in [1, e)
    rollout = [x - d for x, d in zip(old, deltas)]
    metrics = trainer.train_step(dataclasses.replace(batch, rollout_logprobs=rollout))
    adv, delta = torch.cat(batch.advantages).double(), torch.cat(deltas).double()
    w = delta.exp()
    w = w.clamp(max=1.5) if mode == "tis" else torch.where(w <= 1.5, w, torch.zeros_like(w))
    assert metrics["pg_loss"] == pytest.approx(float(-(adv * w).mean()), abs=1e-6)
    assert metrics["logprob_diff_max"] == pytest.approx(float(delta.max()), abs=1e-6)
    assert metrics["logprob_diff_mean"] == pytest.approx(float(delta.mean()), abs=1e-6)
    # k3 of KL(engine || trainer) with r = e^delta; the applied weights; the share cut at the cap
    r = delta.exp()
    assert metrics["mismatch_kl"] == pytest.approx(float((r - 1 - delta).mean()), abs=1e-6)
    assert metrics["is_weight_mean"] == pytest.approx(float(w.mean()), abs=1e-6)
    assert metrics["is_clipped_frac"] == pytest.approx(float((r > 1.5).double().mean()), abs=1e-9)


def test_bf16_mixed_precision_trains_with_fp32_master(tiny_hf_checkpoints):
    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("llama")
    trainer = MegatronTrainer(
        scenarios.trainer_config(
            directory,
            dtype="bfloat16",
            loss=LossConfig(policy_loss="sft"),
            optim=OptimConfig(lr=3e-3, grad_clip=1.0),
        )
    )
    batch = scenarios.fixed_batch(hf_model.config.vocab_size)
    ref, _ = hf_response_logprobs(hf_model, batch.tokens, batch.prompt_lens)
    assert max_abs_diff(trainer.compute_logprobs(batch), ref) <= 0.1  # bf16 rounding only
    losses = [trainer.train_step(batch)["loss"] for _ in range(4)]
    assert losses[-1] < losses[0] - 0.1, losses
    model = trainer.policy
    # every parameter in bf16, the norms' too (megatron's torch-norm wrapper makes them float32):
    # the engine loads bf16 norm weights, and the norm runs torch's same-dtype kernel
    assert {p.dtype for p in model.raw.parameters()} == {torch.bfloat16}
    assert {t.dtype for _, t in trainer.export_hf_weights()} == {torch.bfloat16}
    bf16 = [(p, m) for p, m in zip(model.params, model.master) if p.dtype == torch.bfloat16]
    assert bf16 and all(m.dtype == torch.float32 for m in model.master)
    # the model holds exactly the master weights rounded to bf16
    assert all(torch.equal(p.detach(), m.detach().to(torch.bfloat16)) for p, m in bf16)


def test_export_streams_one_tensor_at_a_time(tiny_hf_checkpoints):
    """The weight-sync contract: a lazy iterator of (hf_name, full tensor), each name once,
    shapes as in the HF checkpoint."""
    import inspect

    from trainer.megatron_trainer import MegatronTrainer

    hf_model, directory = tiny_hf_checkpoints("qwen3")
    trainer = MegatronTrainer(scenarios.trainer_config(directory))
    stream = trainer.export_hf_weights()
    assert inspect.isgenerator(stream)
    first_name, first = next(stream)
    names = [first_name] + [n for n, _ in stream]
    assert len(names) == len(set(names))
    shapes = {k: tuple(v.shape) for k, v in load_file(directory / "model.safetensors").items()}
    assert sorted(names) == sorted(shapes)
    assert tuple(first.shape) == shapes[first_name]
