"""The RL loop end to end: real Ray actors on CPU, real engine, trainer and weight sync.

Short runs of the shipped recipes (scaled down through overrides), checked against the contracts:
every DESIGN metrics key on every step, the same keys in the offline wandb run, the first
update's PPO-KL exactly 0, engine-vs-trainer log-probs within 1e-5, weights synced every step,
checkpoints loadable, the warm start cached, the critic learning.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import torch

from miles_like.recipe.cli import main
from miles_like.run import checkpoint
from miles_like.run.loop import run
from miles_like.run.tracking import REQUIRED_KEYS

from wandb_log import history

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "recipes"
pytestmark = pytest.mark.slow


def train(recipe: str, out: Path, *overrides: str) -> list[dict]:
    code = main([str(RECIPES / recipe), f"tracking.output_dir={out}", *overrides], run=run)
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


SMALL = (
    "rollout.prompts_per_step=4",
    "rollout.n=4",
    "sft.steps=30",
    "sft.batch_size=16",
    "rollout.kv_cache_tokens=2048",
)


UNTIMED_S = 1.0  # a delay the test adds to the step outside every timed phase


def test_colocated_grpo_run_meets_the_contracts(ray_local, cache, tmp_path, monkeypatch):
    out = tmp_path / "grpo"
    # the step that checkpoints starts its checkpoint directory outside every timed phase: a
    # known delay there must show up as the controller's idle time
    begin = checkpoint.begin

    def slow_begin(*args):
        time.sleep(UNTIMED_S)
        return begin(*args)

    monkeypatch.setattr(checkpoint, "begin", slow_begin)
    rows = train(
        "tiny_arith_grpo.yaml",
        out,
        "steps=3",
        *SMALL,
        "trainer.updates_per_rollout=1",
        "checkpoint.every_steps=2",
        "tracking.wandb_project=miles-like-test",
        "tracking.wandb_mode=offline",
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert set(REQUIRED_KEYS) <= r.keys()
        assert r["train/ppo_kl"] == 0.0 and r["train/ratio_max"] == 1.0  # one update / rollout
        # float64 (the recipe's dtype): the engine and the trainer agree to rounding
        assert r["train/logprob_diff_max"] <= 1e-10
        assert r["perf/weight_sync_bytes"] > 0 and r["rollout/samples"] == 16
        # the step's time is accounted for: no phase is counted twice, and the controller's own
        # overhead (idle) is a small part of it, except the untimed delay, which shows up there
        phases = sum(
            v
            for k, v in r.items()
            if k.startswith("perf/")
            and k.endswith("_s")
            and k not in ("perf/step_s", "perf/idle_s", "perf/rollout_tail_s")
        )
        assert phases <= r["perf/step_s"]
        untimed = UNTIMED_S if r["step"] == 1 else 0.0  # the step writing checkpoint step_2
        assert untimed <= r["perf/idle_s"] < untimed + 0.1 * (r["perf/step_s"] - untimed)
        assert r["rollout/prefix_cache_hit_rate"] >= 0.75 - 1e-9  # 4 samples share a prefill
    assert (out / "reward_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the offline wandb run logged the same rows: same keys, same values, same steps
    (run_file,) = (out / "wandb").glob("offline-run-*/run-*.wandb")
    logged = history(run_file)
    assert [h["_step"] for h in logged] == [0, 1, 2]
    for h, r in zip(logged, rows):
        assert {k: h[k] for k in r if k != "step"} == {k: v for k, v in r.items() if k != "step"}
    # the step-2 checkpoint is a loadable HF directory; the warm start was cached
    ckpt = out / "checkpoints" / "step_000002"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in ckpt.iterdir()
    }
    from rollout import Engine, EngineConfig

    Engine(EngineConfig(model_path=str(ckpt), kv_cache_tokens=256))
    # this run's warm start is in the cache (which the session's other runs share)
    assert 30 in [
        json.loads((entry / "warm_start.json").read_text())["steps"]
        for entry in (cache / "warm_start").iterdir()
    ]


def test_warm_start_stops_at_the_loss_target(ray_local, cache, tmp_path, capsys):
    """`sft.stop_loss`: the warm start ends at the first step where the mean of the last
    `sft.stop_window` losses is below the target (recomputed here from the recorded losses),
    well before `sft.steps`, and RL starts from that checkpoint."""
    out = tmp_path / "stop"
    target, window, most = 2.5, 5, 200  # the loss starts near 5.6; 2.5 is passed in tens of steps
    rows = train(
        "tiny_arith_grpo.yaml",
        out,
        "steps=1",
        *SMALL,
        f"sft.steps={most}",
        f"sft.stop_loss={target}",
        f"sft.stop_window={window}",
        "sft.cache=false",
        "trainer.updates_per_rollout=1",
        "tracking.wandb_mode=disabled",
    )
    record = json.loads((out / "warm_start" / "warm_start.json").read_text())
    losses = record["losses"]
    means = [sum(losses[i - window + 1 : i + 1]) / window for i in range(window - 1, len(losses))]
    first = next(i for i, m in enumerate(means) if m < target) + window  # steps run
    assert record["steps"] == len(losses) == first < most
    assert record["max_steps"] == most and record["stop_loss"] == target
    assert f"stopped after {first} steps" in capsys.readouterr().out
    assert [r["step"] for r in rows] == [0]


def test_disaggregated_one_step_off_policy(ray_local, cache, tmp_path, monkeypatch):
    # float32 (the schema default) here, so the loop also runs end to end in it; a reward that
    # varies within groups, so every step moves the policy
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    rows = train(
        "tiny_arith_grpo.yaml",
        tmp_path / "disagg",
        "steps=3",
        *SMALL,
        "model.dtype=float32",
        "reward.function=user_rewards:length_score",
        "cluster.devices=2",
        "cluster.colocate=false",
        "cluster.off_policy_steps=1",
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    # Rollout k+1 is launched during step k, after the engines took the newest weights: at
    # step 0 those are the initial ones (nothing to sync), at step 1 the weights trained at step
    # 0 go over the broadcast group, and the last step launches no rollout.
    assert [r["perf/weight_sync_bytes"] > 0 for r in rows] == [False, True, False]
    assert rows[0]["train/logprob_diff_max"] <= 1e-5  # same weights on both sides at step 0
    # the mismatch metrics compare with the trainer's current weights: at step 0 the float32
    # mismatch alone; at step 1 the samples are one version old, so the policy lag adds to it.
    # From step 1 the trainer also scores them under the weights they were sampled with (a
    # kept copy): the mismatch alone again, and the lag apart from it.
    assert rows[0]["train/mismatch_kl"] <= 1e-9 and "train/policy_lag_kl" not in rows[0]
    assert rows[0]["train/grad_norm"] > 0 and rows[1]["train/mismatch_kl"] > 1e-3
    for r in rows[1:]:
        assert r["train/mismatch_kl_same_weights"] <= 1e-9
        assert r["train/logprob_diff_max_same_weights"] <= 1e-5
        assert r["train/policy_lag_kl"] > 1e-3
    for r in rows:
        assert set(REQUIRED_KEYS) <= r.keys() and r["train/ppo_kl_first_update"] == 0.0


def test_mini_batch_updates(ray_local, cache, tmp_path, monkeypatch):
    """updates_per_rollout = 2: the first mini-batch's PPO-KL is exactly 0, the second's not
    (a reward that varies within groups, so the first update moves the policy)."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    rows = train(
        "tiny_arith_grpo.yaml",
        tmp_path / "mb",
        "steps=2",
        *SMALL,
        "trainer.updates_per_rollout=2",
        "trainer.lr=1e-2",
        "reward.function=user_rewards:length_score",
    )
    for r in rows:
        assert r["train/ppo_kl_first_update"] == 0.0
        assert r["train/ppo_kl"] != 0.0  # mean of 0 and the second update's (off-policy)


def test_dapo_dynamic_sampling_keeps_the_batch_size(ray_local, cache, tmp_path):
    rows = train(
        "tiny_arith_dapo.yaml",
        tmp_path / "dapo",
        "steps=2",
        *SMALL,
        "algorithm.dynamic_sampling_max_rounds=2",
    )
    for r in rows:
        rounds = r["rollout/dynamic_rounds"]
        kept = r["rollout/dynamic_kept_groups"]
        # a full batch, or after the last allowed round whatever informative groups there are
        assert 1 <= rounds <= 3 and 1 <= kept <= 4 and (kept == 4 or rounds == 3)
        assert r["rollout/samples"] == 4 * kept
        # every group generated in a round beyond the first replaced a dropped one
        assert r["rollout/dynamic_dropped_groups"] >= (rounds > 1)
        assert set(REQUIRED_KEYS) <= r.keys()


def test_ppo_critic_value_loss_falls(ray_local, cache, tmp_path, monkeypatch):
    # A dense reward (the response length) from a policy that barely moves (no warm start, lr
    # 1e-9): the critic's targets are stationary, so its value loss must fall as it fits them.
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    rows = train(
        "tiny_arith_ppo.yaml",
        tmp_path / "ppo",
        "steps=10",
        "rollout.prompts_per_step=8",
        "rollout.n=2",
        "sft.steps=0",
        "trainer.lr=1e-9",
        "trainer.critic_lr=1e-2",
        "reward.function=user_rewards:length_score",
    )
    losses = [r["train/critic_value_loss"] for r in rows]
    assert sum(losses[-3:]) / 3 < 0.5 * sum(losses[:2]) / 2, losses
    # the zero-initialized value head predicts 0 everywhere: 1 - Var(R - 0) / Var(R) = 0
    assert rows[0]["train/critic_explained_var"] == 0.0


def test_real_model_recipe_on_a_scaled_down_model(ray_local, cache, tmp_path, monkeypatch):
    """The GPU recipe, unchanged but for paths, sizes and its reward, on a random-init Qwen2 with
    a local BPE tokenizer and chat template, GSM8K-style rows. A random model never earns the
    math reward (every advantage 0: nothing is learned), so the reward is one it earns by
    construction, the response's length, which differs within every group: each step takes a
    real bf16 update. At the recipe's learning rate (1e-6 after a 10-step warmup) an update
    moves the fp32 master weights by ~1e-7, which changes a bf16 weight only where that crosses
    a bf16 rounding step (the smallest weights): the model stays the near-uniform one the
    mismatch bounds were measured on, and after the second update its bf16 weights differ."""
    from safetensors.torch import load_file

    from rollout.random_checkpoint import write_random_checkpoint

    from tiny_hf import save_bpe_tokenizer

    rows = [
        {
            "question": f"Tom has {a} apples and buys {b} more. How many now?",
            "answer": f"He has {a} + {b} = {a + b} apples.\n#### {a + b}",
        }
        for a, b in [(3, 4), (10, 5), (7, 8), (2, 9), (6, 6), (1, 12)]
    ]
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    model = tmp_path / "model"
    tok = save_bpe_tokenizer(model, [r["question"] + r["answer"] for r in rows] * 20)
    write_random_checkpoint(
        model,
        dict(
            architectures=["Qwen2ForCausalLM"],
            model_type="qwen2",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=len(tok),
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_theta=1e6,
            tie_word_embeddings=True,
            hidden_act="silu",
            eos_token_id=tok.eos_token_id,
            torch_dtype="bfloat16",
        ),
        seed=0,
    )
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent))
    out = tmp_path / "qwen"
    got = train(
        "qwen2.5-0.5b-gsm8k-grpo.yaml",
        out,
        f"model.path={model}",
        f"data.path={data}",
        "steps=2",
        "rollout.prompts_per_step=2",
        "rollout.n=2",
        "rollout.max_new_tokens=16",
        "rollout.kv_cache_tokens=1024",
        "rollout.max_running_requests=16",
        "trainer.max_tokens_per_micro_batch=512",
        "cluster.devices=1",
        "cluster.accelerator=cpu",
        "reward.max_workers=2",
        "reward.function=user_rewards:length_score",
        "checkpoint.every_steps=2",
        "tracking.wandb_project=null",
    )
    assert len(got) == 2 and all(set(REQUIRED_KEYS) <= r.keys() for r in got)
    for r in got:
        # bf16 engine vs bf16 trainer on this near-uniform model (entropy ~5.7 nats): bounds
        # are the measured values (benchmarks/RESULTS.md) x 2 for the max, x 1.5 for averages
        assert r["train/logprob_diff_max"] <= 4e-3 and r["train/logprob_diff_mean"] <= 6e-4
        assert r["train/logprob_diff_seq_mean_max"] <= 9e-4
        assert r["train/logprob_diff_large_frac"] == 0.0
        assert 0 < r["train/mismatch_kl"] <= 2.5e-7
        # the recipe's TIS: weights pi_trainer / pi_engine this close to 1 are never cut
        assert abs(r["train/is_weight_mean"] - 1.0) <= 1.5e-4 and r["train/is_clipped_frac"] == 0
        # rewards that differ within the groups: a real, finite gradient every step
        assert r["rollout/reward_group_std_mean"] > 0
        assert math.isfinite(r["train/grad_norm"]) and r["train/grad_norm"] > 0
        assert r["train/update_skipped"] == 0
    # the first step's policy is its bf16 reference bitwise: the recipe's KL term is exactly 0
    assert got[0]["train/kl"] == 0.0
    # the two updates changed some of the bf16 matrices the run ends with, compared in bf16
    # (the run loaded the initial weights rounded to it; the norms it keeps in float32)
    initial = load_file(model / "model.safetensors")
    final = load_file(out / "checkpoints" / "step_000002" / "model.safetensors")
    assert initial.keys() == final.keys()
    bf16 = [k for k, t in final.items() if t.dtype == torch.bfloat16]
    assert len(bf16) >= 2 * 4  # q, k, v, o, gate, up, down per layer, the embedding
    changed = sum(int((initial[k].to(torch.bfloat16) != final[k]).sum()) for k in bf16)
    assert 0 < changed < 0.5 * sum(final[k].numel() for k in bf16)  # the smallest weights only


def test_run_time_user_errors_are_one_line(ray_local, cache, tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    code = main(
        [
            str(RECIPES / "tiny_arith_grpo.yaml"),
            "data.synthetic=null",
            f"data.path={data}",
            f"tracking.output_dir={tmp_path / 'o'}",
        ],
        run=run,
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "data.prompt_key='prompt'" in err
