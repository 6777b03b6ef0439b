"""Checkpoints: the whole state of a run, so that a resumed run continues exactly where the
checkpoint was taken (same samples, same updates, same metrics as a run never stopped).

`tracking.output_dir/checkpoints/step_000012/` is written after step 11 (12 is the next step):

    config.json, model.safetensors, tokenizer files   the policy: a Hugging Face directory (usable
                                                      as model.path)
    trainer/rank_00000.pt   per trainer rank: optimizer state, LR-schedule position, skipped-step
                            count, fp32 master weights (bf16 runs), the critic's weights and
                            optimizer (PPO), RNG states (torch, python, numpy)
    engine/                 off-policy runs: the weights the pending rollout is generated with,
                            one version behind the policy (Hugging Face directory)
    reference/              runs with a KL term: the frozen reference (hard links when possible)
    controller.pt           the controller's RNG states
    state.json              next step, data position, weight version, wandb run id, trainer
                            layout, the step's metrics row, over-sampled runs' carried partial
                            groups (`oversampling.to_state`); written last

The loops write one in three calls: `save_policy` (the trainer's side: weights, every rank's
training state, the reference), `save_engine_weights` (off-policy runs), then `finish` (the
controller's state.json, the rename). It is written into `.tmp-step_000012/` and renamed: a `step_*`
directory holding a `state.json` is complete, and resuming considers nothing else. Old checkpoints
are renamed to `.del-*` before they are deleted, for the same reason. Every `.pt` file holds only
tensors and plain Python values and is read with `torch.load(weights_only=True)`; weights are
safetensors.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from miles_like.errors import RecipeError
from miles_like.run.calls import start_call, wait_all

STATE_FILE = "state.json"
CONTROLLER_FILE = "controller.pt"
ENGINE_DIR = "engine"
REFERENCE_DIR = "reference"
TRAINER_DIR = "trainer"
FORMAT = 1
OWN_FILES = frozenset({STATE_FILE})  # not copied along with a checkpoint's model files
_STEP_DIR = re.compile(r"step_(\d+)$")


def checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def rank_file(directory: Path, rank: int) -> Path:
    return Path(directory) / TRAINER_DIR / f"rank_{rank:05d}.pt"


def is_complete(directory: Path) -> bool:
    return (Path(directory) / STATE_FILE).is_file()


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The complete checkpoints of `output_dir`, oldest first (interrupted writes left as
    `.tmp-*` directories, and directories without a state.json, are not among them)."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in root.iterdir()
        if p.is_dir() and (m := _STEP_DIR.match(p.name)) and is_complete(p)
    ]
    return [p for _, p in sorted(found)]


def check_checkpoint_dir(path: Path, field: str) -> None:
    """A RecipeError naming `field` unless `path` is a complete checkpoint."""
    hint = "give a directory tracking.output_dir/checkpoints/step_N, or auto"
    if not path.is_dir():
        raise RecipeError(f"{field}={str(path)!r}: no such checkpoint directory; {hint}")
    if not is_complete(path):
        raise RecipeError(
            f"{field}={str(path)!r} is not a complete checkpoint (no {STATE_FILE}: "
            f"its writing was interrupted, or it predates resumable checkpoints); "
            f"{hint}"
        )
    read_state(path)  # a damaged state.json is found before anything starts


def resolve_resume(recipe, log: Callable[[str], None] = print) -> Path | None:
    """The checkpoint this run continues from, or None for a fresh run."""
    resume = recipe.checkpoint.resume
    if resume is False:
        return None
    if resume == "auto":
        found = complete_checkpoints(Path(recipe.tracking.output_dir))
        if not found:
            log(
                f"resume: no complete checkpoint in "
                f"{checkpoints_dir(Path(recipe.tracking.output_dir))}; starting fresh"
            )
            return None
        log(f"resume: continuing from {found[-1]}")
        return found[-1]
    path = Path(resume).expanduser()
    check_checkpoint_dir(path, "checkpoint.resume")
    log(f"resume: continuing from {path}")
    return path


def refuse_earlier_run(output_dir: Path) -> None:
    """A fresh run that writes checkpoints must not mix them with an earlier run's: `auto`
    would later pick whichever has the higher step."""
    found = complete_checkpoints(output_dir)
    if found:
        raise RecipeError(
            f"tracking.output_dir={str(output_dir)!r} already holds checkpoints of "
            f"an earlier run (latest {found[-1].name}); set checkpoint.resume: auto "
            "to continue it, or use another output_dir (or delete them)"
        )


def trainer_layout(recipe, ranks: int) -> dict:
    """What a resumed run must match for the per-rank training states to fit."""
    tr = recipe.trainer
    return {"trainer_ranks": ranks, "tp": tr.tp, "pp": tr.pp, "backend": tr.backend}


def check_same_layout(recipe, state: dict, ranks: int) -> None:
    now = trainer_layout(recipe, ranks)
    then = {k: state[k] for k in now}
    if now != then:
        raise RecipeError(
            f"checkpoint.resume: the checkpoint was written with {then}, this "
            f"recipe gives {now}; resume with the same cluster.devices, "
            "cluster.rollout_devices and trainer.tp / pp / backend"
        )


def read_state(directory: Path) -> dict[str, Any]:
    file = Path(directory) / STATE_FILE
    try:
        state = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RecipeError(
            f"checkpoint.resume: {file} cannot be read ({type(e).__name__}: {e}): "
            "the checkpoint is damaged; resume from an earlier one "
            "(checkpoint.resume=.../step_N) or move this one away"
        ) from None
    if not isinstance(state, dict):
        raise RecipeError(
            f"checkpoint.resume: {file} is not a JSON object: the checkpoint is "
            "damaged; resume from an earlier one (checkpoint.resume=.../step_N) or "
            "move this one away"
        )
    if state.get("format") != FORMAT:
        raise RecipeError(
            f"checkpoint.resume: {directory} has checkpoint format "
            f"{state.get('format')}, this version reads {FORMAT}; resume it with "
            "the version that wrote it"
        )
    return state


def load_trainer_states(trainers: list, directory: Path, timeout_s: float) -> None:
    """Every trainer rank's training state from the checkpoint (after `build` from its
    weights)."""
    wait_all(
        [
            start_call(f"trainer rank {rank}", t, "load_state", str(rank_file(directory, rank)))
            for rank, t in enumerate(trainers)
        ],
        timeout_s,
    )


# ---------------------------------------------------------------------------------- writing
def begin(output_dir: Path, step: int) -> Path:
    """A fresh temporary directory for the checkpoint `step_{step}` (any leftover of an
    interrupted write is removed)."""
    tmp = checkpoints_dir(output_dir) / f".tmp-step_{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def save_policy(actors, directory: Path) -> None:
    """The trainer's side of a checkpoint (`actors`: the run's `RunActors`): the policy (HF
    files in `directory`), every rank's training state and, with a KL term, the reference. The
    controller's state is the loop's (`finish`)."""
    actors.save_hf(directory)
    wait_all(
        [
            start_call(f"trainer rank {rank}", t, "save_state", str(rank_file(directory, rank)))
            for rank, t in enumerate(actors.trainers)
        ],
        actors.timeout_s,
    )
    if actors.reference_dir is not None:
        save_reference(
            actors.reference_dir,
            directory / REFERENCE_DIR,
            Path(actors.recipe.tracking.output_dir),
        )


def save_engine_weights(actors, directory: Path) -> None:
    """Off-policy: the trainer's current weights, which the engines are generating the pending
    rollout with (call it between that rollout's launch and the next train)."""
    actors.save_hf(directory / ENGINE_DIR)


def finish(actors, tmp: Path, state: dict[str, Any]) -> Path:
    """Complete the checkpoint written into `tmp` (`commit`). The next one takes the reference
    from it: the one this run started from may be deleted (keep_last)."""
    final = commit(tmp, state, actors.recipe.checkpoint.keep_last)
    if actors.reference_dir is not None:
        actors.reference_dir = final / REFERENCE_DIR
    return final


def commit(tmp: Path, state: dict[str, Any], keep_last: int) -> Path:
    """Write `state.json` (last, flushed to disk), rename `tmp` to its final name, keep only
    the newest `keep_last` complete checkpoints. Returns the checkpoint's directory."""
    final = tmp.with_name(tmp.name.removeprefix(".tmp-"))
    with (tmp / STATE_FILE).open("w") as f:
        json.dump({"format": FORMAT, **state}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    if final.exists():
        _delete(final)
    tmp.rename(final)
    for old in complete_checkpoints(tmp.parent.parent)[:-keep_last]:
        _delete(old)
    for leftover in tmp.parent.glob(".del-*"):  # deletions a killed run left unfinished
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def _delete(directory: Path) -> None:
    """Renamed out of the `step_*` names first (atomic), so that a run killed while deleting
    never leaves a checkpoint that looks complete but lacks files."""
    doomed = directory.with_name(f".del-{directory.name}")
    shutil.rmtree(doomed, ignore_errors=True)
    directory.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def save_reference(src: Path, dst: Path, output_dir: Path) -> None:
    """The frozen reference's files (not subdirectories) from `src` into `dst`. Hard links when
    `src` is an earlier checkpoint of this run (never modified in place, and deleted only after a
    newer one holds the links); copies otherwise (a user's model directory might be rewritten)."""
    dst.mkdir(parents=True, exist_ok=True)
    ours = checkpoints_dir(output_dir).resolve() in Path(src).resolve().parents
    for f in Path(src).iterdir():
        if not f.is_file() or f.name == STATE_FILE:
            continue
        if ours:
            try:
                os.link(f, dst / f.name)
                continue
            except OSError:
                pass
        shutil.copy2(f, dst / f.name)
