"""Where a run's numbers go: `metrics.jsonl` (one JSON object per step, flushed as written), the
same keys to wandb (offline by default; the environment's WANDB_MODE wins when set), one console
line per step, and at the end `reward_curve.png` (reward mean and spread, response length, vs
step), all in `tracking.output_dir`.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

# The keys DESIGN.md promises in every metrics.jsonl row (tests and benchmarks read them).
REQUIRED_KEYS = (
    "step", "rollout/reward_mean", "rollout/response_len_mean", "rollout/tokens_per_s",
    "rollout/prefix_cache_hit_rate", "train/loss", "train/kl", "train/entropy", "train/grad_norm",
    "train/logprob_diff_max", "train/logprob_diff_mean", "perf/step_s", "perf/rollout_s",
    "perf/train_s", "perf/weight_sync_s", "perf/weight_sync_bytes", "perf/idle_s",
)

CONSOLE_COLUMNS = (("step", "step", "{:>4d}"), ("rollout/reward_mean", "reward", "{:>6.3f}"),
                   ("rollout/response_len_mean", "len", "{:>5.1f}"),
                   ("train/loss", "loss", "{:>8.4f}"), ("train/entropy", "entropy", "{:>7.3f}"),
                   ("train/logprob_diff_max", "lp_diff", "{:>8.1e}"),
                   ("perf/step_s", "step_s", "{:>6.2f}"), ("perf/idle_frac", "idle", "{:>5.1%}"))


class Tracker:
    def __init__(self, output_dir: str | Path, config: dict[str, Any], *,
                 wandb_project: str | None = None, wandb_mode: str = "offline", print_fn=print):
        self.dir = Path(output_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        self._file = self.path.open("w")
        self.rows: list[dict[str, Any]] = []
        self.print = print_fn
        self.wandb_run = None
        if wandb_project is not None:
            import wandb
            mode = os.environ.get("WANDB_MODE", wandb_mode)
            self.wandb_run = wandb.init(project=wandb_project, mode=mode, dir=str(self.dir),
                                        config=config, reinit="finish_previous")
        self._header_printed = False

    def log(self, row: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in row]
        if missing:
            raise KeyError(f"metrics row lacks {missing}")  # a bug of ours, not the user's
        clean = {k: _json_number(v) for k, v in row.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        self.rows.append(clean)
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in clean.items() if k != "step"},
                               step=int(row["step"]))
        self._console(clean)

    def _console(self, row: dict[str, Any]) -> None:
        widths = [len(fmt.format(0 if "d" in fmt else 0.0)) for _, _, fmt in CONSOLE_COLUMNS]
        if not self._header_printed:
            self.print("  ".join(f"{title:>{w}}" for (_, title, _), w in zip(CONSOLE_COLUMNS, widths)))
            self._header_printed = True
        self.print("  ".join("-".rjust(w) if row.get(key) is None else fmt.format(row[key])
                             for (key, _, fmt), w in zip(CONSOLE_COLUMNS, widths)))

    def finish(self) -> Path | None:
        self._file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
        return plot_reward_curve(self.rows, self.dir / "reward_curve.png") if self.rows else None


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
    ax_r.fill_between(steps, [m - s for m, s in zip(mean, std)],
                      [m + s for m, s in zip(mean, std)], alpha=0.25, label="± std")
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
