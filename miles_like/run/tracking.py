"""Where a run's numbers go: `metrics.jsonl` (one JSON object per step, flushed as written), the
same keys to wandb (offline by default; the environment's WANDB_MODE wins when set), one console
line per step, and at the end `reward_curve.png` (reward mean and spread, response length, vs
step), all in `tracking.output_dir`. A resumed run continues the same file and wandb run
(`Tracker(resume_step=...)`).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

# The keys DESIGN.md promises in every metrics.jsonl row (tests and benchmarks read them).
REQUIRED_KEYS = (
    "step",
    "rollout/reward_mean",
    "rollout/response_len_mean",
    "rollout/tokens_per_s",
    "rollout/prefix_cache_hit_rate",
    "train/loss",
    "train/kl",
    "train/entropy",
    "train/grad_norm",
    "train/logprob_diff_max",
    "train/logprob_diff_mean",
    "perf/step_s",
    "perf/rollout_s",
    "perf/train_s",
    "perf/weight_sync_s",
    "perf/weight_sync_bytes",
    "perf/idle_s",
)

CONSOLE_COLUMNS = (
    ("step", "step", "{:>4d}"),
    ("rollout/reward_mean", "reward", "{:>6.3f}"),
    ("rollout/response_len_mean", "len", "{:>5.1f}"),
    ("train/loss", "loss", "{:>8.4f}"),
    ("train/entropy", "entropy", "{:>7.3f}"),
    ("train/logprob_diff_max", "lp_diff", "{:>8.1e}"),
    ("perf/step_s", "step_s", "{:>6.2f}"),
    ("perf/idle_frac", "idle", "{:>5.1%}"),
)


class Tracker:
    """`resume_step`: continue a run from its checkpoint taken before step `resume_step`:
    metrics.jsonl keeps the rows of earlier steps (a killed run may have written rows after its
    last checkpoint: they are dropped), `last_row` (the checkpoint's copy of the row of step
    `resume_step - 1`) replaces or restores that row, and wandb continues `wandb_run_id`."""

    def __init__(
        self,
        output_dir: str | Path,
        config: dict[str, Any],
        *,
        wandb_project: str | None = None,
        wandb_mode: str = "offline",
        print_fn=print,
        resume_step: int | None = None,
        last_row: dict[str, Any] | None = None,
        wandb_run_id: str | None = None,
    ):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self.rows: list[dict[str, Any]] = []
        relog = None
        if resume_step is not None:
            self.rows, relog = _rows_before(self.path, resume_step, last_row)
            tmp = self.path.with_name(".metrics.jsonl.tmp")
            tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            tmp.replace(self.path)
        self._file = self.path.open("a" if resume_step is not None else "w")
        self.print = print_fn
        self.wandb_run = None
        if wandb_project is not None:
            import wandb

            mode = os.environ.get("WANDB_MODE", wandb_mode)
            resume = {"id": wandb_run_id, "resume": "allow"} if wandb_run_id else {}
            self.wandb_run = wandb.init(
                project=wandb_project,
                mode=mode,
                dir=str(self.dir),
                config=config,
                reinit="finish_previous",
                **resume,
            )
            if relog is not None:  # the killed run stopped before logging it anywhere
                self._wandb_log(relog)
        self._header_printed = False

    @property
    def wandb_run_id(self) -> str | None:
        return None if self.wandb_run is None else self.wandb_run.id

    def log(self, row: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}")  # a bug of ours, not the user's
        clean = json_row(row)
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        self.rows.append(clean)
        self._wandb_log(clean)
        self._console(clean)

    def _wandb_log(self, row: dict[str, Any]) -> None:
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=int(row["step"]))

    def _console(self, row: dict[str, Any]) -> None:
        widths = [len(fmt.format(0 if "d" in fmt else 0.0)) for _, _, fmt in CONSOLE_COLUMNS]
        if not self._header_printed:
            self.print(
                "  ".join(f"{title:>{w}}" for (_, title, _), w in zip(CONSOLE_COLUMNS, widths))
            )
            self._header_printed = True
        self.print(
            "  ".join(
                "-".rjust(w) if row.get(key) is None else fmt.format(row[key])
                for (key, _, fmt), w in zip(CONSOLE_COLUMNS, widths)
            )
        )

    def finish(self) -> Path | None:
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        return plot_reward_curve(self.rows, self.dir / "reward_curve.png") if self.rows else None


def _rows_before(
    path: Path, step: int, last_row: dict[str, Any] | None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The rows of `path` for steps before `step`, the one of step - 1 taken from `last_row`;
    and `last_row` again when `path` lacked it (it still has to go to wandb), else None."""
    rows = []
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    kept = [r for r in rows if r["step"] < step]
    if last_row is None:
        return kept, None
    had_it = any(r["step"] == last_row["step"] for r in kept)
    kept = [r for r in kept if r["step"] != last_row["step"]] + [last_row]
    return kept, None if had_it else last_row


def json_row(row: dict[str, Any]) -> dict[str, Any]:
    """A metrics row as written to metrics.jsonl."""
    return {k: _json_number(v) for k, v in row.items()}


def _json_number(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN / inf; keep them visible rather than dropping the key
    return v


def plot_reward_curve(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    mean = [r["rollout/reward_mean"] for r in rows]
    std = [r.get("rollout/reward_std", 0.0) for r in rows]
    length = [r["rollout/response_len_mean"] for r in rows]
    fig, (ax_r, ax_l) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    ax_r.plot(steps, mean, label="reward mean")
    ax_r.fill_between(
        steps,
        [m - s for m, s in zip(mean, std)],
        [m + s for m, s in zip(mean, std)],
        alpha=0.25,
        label="± std",
    )
    ax_r.set_ylabel("reward")
    ax_r.legend(loc="lower right")
    ax_r.grid(alpha=0.3)
    ax_l.plot(steps, length, color="tab:green")
    ax_l.set_ylabel("response tokens (mean)")
    ax_l.set_xlabel("step")
    ax_l.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
