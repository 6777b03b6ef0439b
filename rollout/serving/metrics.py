"""`/metrics`: the engine's and the server's counters in Prometheus' text exposition format.

Written by hand (a few lines of text) rather than with `prometheus_client`: it is not a
dependency of the project, and its process-wide default registry would make two servers in one
process (tests, a router beside its replicas) share and clash over metric names.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

from rollout.async_engine import GenerationResult


class ServingMetrics:
    """What the server itself counts (thread-safe): requests answered by route and status, and
    the prompt / completion tokens of the generations it served."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = 0
        self.generation_tokens = 0

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] = self.requests.get((route, status), 0) + 1

    def served(self, results: list[GenerationResult]) -> None:
        with self._lock:
            self.prompt_tokens += sum(len(r.prompt_token_ids) for r in results)
            self.generation_tokens += sum(len(s.token_ids) for r in results for s in r.samples)


# (name, type, help, key of Engine.stats())
ENGINE_METRICS = (
    ("num_requests_running", "gauge", "Sequences decoding or prefilling.", "running_sequences"),
    ("num_requests_waiting", "gauge", "Sequences waiting for admission.", "waiting_sequences"),
    ("num_requests_in_flight", "gauge", "Requests submitted, not yet done.", "async_in_flight"),
    ("kv_cache_free_tokens", "gauge", "Free KV slots.", "kv_free_tokens"),
    ("kv_cache_tokens", "gauge", "KV slots of the pool.", "kv_pool_tokens"),
    ("prefix_cache_tokens", "gauge", "Tokens held by the prefix cache.", "prefix_cache_tokens"),
    ("weight_version", "gauge", "Weight updates applied.", "weight_version"),
    ("prefill_tokens_total", "counter", "Prompt tokens computed.", "prefill_tokens_computed"),
    (
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens taken from the prefix cache.",
        "prefix_cache_hit_tokens",
    ),
    ("generated_tokens_total", "counter", "Tokens sampled.", "generated_tokens"),
    ("preemptions_total", "counter", "Sequences preempted.", "preemptions"),
    ("forward_passes_total", "counter", "Engine forward passes.", "forward_passes"),
)
PREFIX = "miles_like_"


def prometheus_text(stats: Mapping[str, float], served: ServingMetrics, model: str) -> str:
    """The text exposition of `stats` (`AsyncEngine.stats()`) and `served`, every sample labelled
    with the served model's name."""
    label = f'model_name="{_escape(model)}"'
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {PREFIX}{name} {help_}")
        lines.append(f"# TYPE {PREFIX}{name} {kind}")
        for labels, value in samples:
            lines.append(f"{PREFIX}{name}{{{labels}}} {_number(value)}")

    for name, kind, help_, key in ENGINE_METRICS:
        metric(name, kind, help_, [(label, stats.get(key, 0))])
    hits, computed = (
        stats.get("prefix_cache_hit_tokens", 0),
        stats.get("prefill_tokens_computed", 0),
    )
    metric(
        "prefix_cache_hit_rate",
        "gauge",
        "Share of prompt tokens taken from the prefix cache.",
        [(label, hits / (hits + computed) if hits + computed else 0.0)],
    )
    with served._lock:
        requests = sorted(served.requests.items())
        prompt, generation = served.prompt_tokens, served.generation_tokens
    metric(
        "requests_total",
        "counter",
        "HTTP requests answered, by route and status.",
        [(f'{label},route="{_escape(r)}",status="{code}"', n) for (r, code), n in requests],
    )
    metric("prompt_tokens_total", "counter", "Prompt tokens of served requests.", [(label, prompt)])
    metric(
        "generation_tokens_total",
        "counter",
        "Completion tokens of served requests.",
        [(label, generation)],
    )
    return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(int(value))
