"""The supervised warm start: a few SFT steps on the data's (prompt, answer) pairs before RL, so
that a randomly initialized tiny model answers in the task's format and RL has a signal to work
with. It runs on the trainer workers (the same TP / PP layout as RL), writes a Hugging Face
directory into the cache, and the RL run starts from that directory. With `sft.cache` a finished
warm start with the same inputs is reused instead of recomputed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import ray
import torch

from miles_like.data import PromptSource
from miles_like.models.store import cached_dir, content_key, copy_model_files
from miles_like.recipe.build_configs import trainer_config
from miles_like.rollouts import tool_loop
from miles_like.rollouts.tools import load_tools
from miles_like.run.calls import start_on_all, wait_all
from miles_like.tasks import calc
from trainer import RLBatch
from trainer.config import LossConfig, OptimConfig

SFT_DATA_SEED_OFFSET = 7919  # warm-start problems come from a stream other than RL's


def sft_batch(problems, tokenizer, demonstrate=None, tools=None) -> RLBatch:
    """(prompt, answer) pairs; with `demonstrate` (problem -> the messages that solve it) whole
    conversations, tokenized as the tool loop tokenizes them (`tool_loop.demonstration`, the
    prompt showing `tools`), the loss only on the assistant turns' tokens."""
    if demonstrate is None:
        tokens, prompt_lens = [], []
        for p in problems:
            tokens.append(list(p.prompt_ids) + tokenizer.encode_response(p.answer))
            prompt_lens.append(len(p.prompt_ids))
        return RLBatch(tokens=tokens, prompt_lens=prompt_lens)
    samples = [tool_loop.demonstration(tokenizer, p, demonstrate(p), tools) for p in problems]
    return RLBatch(
        tokens=[list(t.token_ids) for t in samples],
        prompt_lens=[t.prompt_len for t in samples],
        loss_masks=[torch.tensor(t.loss_mask, dtype=torch.float32) for t in samples],
    )


def demonstrations(recipe) -> tuple[Callable | None, list[dict] | None]:
    """What `sft_batch` demonstrates for the recipe's task: (problem -> messages, the tools'
    schemas the prompt shows), or (None, None) for plain (prompt, answer) pairs. The calculator
    task demonstrates its tool when `rollout.tools` has it."""
    if recipe.data.synthetic != "calc":
        return None, None
    tools = load_tools(recipe.rollout.tools)
    names = tuple(t.name for t in tools)
    return (
        (lambda p: calc.demonstration(p.prompt, p.answer, names)),
        tool_loop.prompt_tools([t.schema for t in tools], recipe.rollout),
    )


def code_files() -> list[Path]:
    """The source a warm start's weights depend on besides the recipe: the trainer package (the
    backends, the objective, the optimizer) and the config.json parser it builds from
    (`model_spec`), this file (the SFT batches), the prompt stream, the tasks, the tokenizer,
    the tool loop's demonstrations (and the tool schemas they render) and the trainer
    configuration built from the recipe."""
    import model_spec
    import trainer
    from miles_like import data, tasks
    from miles_like.models import tokenizer
    from miles_like.recipe import build_configs
    from miles_like.rollouts import tool_schema, tools

    return sorted(
        [
            *Path(trainer.__file__).parent.rglob("*.py"),
            *Path(model_spec.__file__).parent.rglob("*.py"),
            *Path(tasks.__file__).parent.rglob("*.py"),
            Path(__file__),
            *(
                Path(m.__file__)
                for m in (data, tokenizer, build_configs, tool_loop, tools, tool_schema)
            ),
        ]
    )


def code_version() -> str:
    """A hash of `code_files()`. A hash, not a version constant to bump: a changed trainer or
    task can never reuse an old SFT checkpoint because someone forgot; the price is a recomputed
    warm start (seconds to minutes) after any edit to those files, comments included."""
    digest = hashlib.sha256()
    for f in code_files():
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _identity(recipe, base_dir: Path) -> list:
    """What the warm start's result depends on."""
    weights = sorted(
        (f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in base_dir.glob("*.safetensors")
    )
    return [
        code_version(),
        str(base_dir.resolve()),
        weights,
        dataclasses.asdict(recipe.sft),
        dataclasses.asdict(recipe.data),
        recipe.seed,
        recipe.model.dtype,
        recipe.trainer.backend,
        recipe.trainer.tp,
        recipe.trainer.pp,
        recipe.trainer.max_tokens_per_micro_batch,
        recipe.rollout.max_new_tokens,
        recipe.rollout.tools,
        recipe.rollout.tool_schemas_in_prompt,
    ]  # calc's demonstrations


def reached_stop_loss(losses: list[float], stop_loss: float | None, window: int) -> bool:
    """Whether the warm start stops after these steps: the mean of the last `window` losses is
    below `stop_loss` (a mean: one lucky batch does not stop it)."""
    if stop_loss is None or len(losses) < window:
        return False
    return sum(losses[-window:]) / window < stop_loss


def warm_start(
    recipe, base_dir: Path, trainers: list, tokenizer, max_prompt_tokens: int, log=print
) -> Path:
    """The directory RL starts from: `base_dir` itself when `sft.steps == 0`, else the cached
    (or freshly trained) warm start of it."""
    sft, timeout_s = recipe.sft, recipe.cluster.call_timeout_s
    if sft.steps == 0:
        return base_dir

    def build(out: Path) -> None:
        cfg = trainer_config(recipe, str(base_dir))
        cfg = dataclasses.replace(
            cfg,
            use_reference=False,
            loss=LossConfig(policy_loss="sft", loss_agg="token-mean"),
            optim=OptimConfig(lr=sft.lr, grad_clip=cfg.optim.grad_clip, total_steps=sft.steps),
        )
        wait_all(start_on_all("trainer rank", trainers, "build", cfg), timeout_s)
        source = PromptSource(
            recipe.data,
            tokenizer,
            seed=recipe.seed + SFT_DATA_SEED_OFFSET,
            max_prompt_tokens=max_prompt_tokens,
        )
        demonstrate, tools = demonstrations(recipe)
        start, losses = time.perf_counter(), []
        for step in range(sft.steps):
            batch = ray.put(
                sft_batch(source.next_batch(sft.batch_size), tokenizer, demonstrate, tools)
            )
            calls = start_on_all("trainer rank", trainers, "train", batch, 1)
            metrics = wait_all(calls, timeout_s)[0]
            losses.append(metrics["loss"])
            stop = reached_stop_loss(losses, sft.stop_loss, sft.stop_window)
            if step % max(1, sft.steps // 10) == 0 or step == sft.steps - 1 or stop:
                log(f"warm start: step {step + 1}/{sft.steps}  loss {metrics['loss']:.4f}")
            if stop:
                log(
                    f"warm start: mean loss of the last {sft.stop_window} steps below "
                    f"sft.stop_loss={sft.stop_loss}: stopped after {step + 1} steps"
                )
                break
        wait_all(start_on_all("trainer rank", trainers, "save_hf", str(out)), timeout_s)
        copy_model_files(base_dir, out)
        (out / "warm_start.json").write_text(
            json.dumps(
                {
                    "steps": len(losses),
                    "max_steps": sft.steps,
                    "stop_loss": sft.stop_loss,
                    "losses": losses,
                    "seconds": time.perf_counter() - start,
                    "base": str(base_dir),
                },
                indent=2,
            )
        )

    if not sft.cache:  # recomputed every run, kept with the run's outputs
        out = Path(recipe.tracking.output_dir) / "warm_start"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        build(out)
        return out
    name = f"warm_start/{content_key(_identity(recipe, base_dir))}"
    return cached_dir(name, build)
