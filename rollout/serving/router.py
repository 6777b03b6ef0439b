"""Which engine replica serves a request: cache-aware (as SGLang's router) or round-robin.

Cache-aware: per replica an approximate prefix tree of the token ids it was sent (and, once
known, the ids it sampled: `record`), bounded in size with least-recently-used leaves dropped,
standing in for the replica's radix cache without asking it. A request goes to the replica with
the longest matched prefix, unless that replica's load (requests in flight) exceeds the least
loaded one's by more than `balance_threshold`, then to the least loaded; with no match anywhere,
to the least loaded (among equals, the one whose tree holds fewest tokens). Round-robin, the
baseline, ignores prefixes and sessions. A session id sticks to the replica it was first sent to
(its cache is there); a group's n samples travel as one request, so they go together.

Pure and in-process: `choose(token_ids, session_id) -> replica`, then `started(i)` /
`finished(i)` around the request. The HTTP front is `rollout.serving.router_app`.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

POLICIES = ("cache_aware", "round_robin")


@dataclass(eq=False)
class _Node:
    parent: _Node | None
    token: int
    children: dict[int, _Node] = field(default_factory=dict)
    last_used: int = 0


class PrefixTree:
    """A token trie holding at most `max_tokens` tokens (one node per token)."""

    def __init__(self, max_tokens: int = 1 << 20):
        self.root = _Node(None, -1)
        self.max_tokens = max_tokens
        self.num_tokens = 0
        self._clock = itertools.count(1)

    def match(self, tokens: Sequence[int]) -> int:
        """Length of the longest prefix of `tokens` in the tree."""
        node, n = self.root, 0
        for t in tokens:
            node = node.children.get(t)
            if node is None:
                break
            n += 1
        return n

    def insert(self, tokens: Sequence[int]) -> None:
        now = next(self._clock)
        node = self.root
        for t in tokens:
            child = node.children.get(t)
            if child is None:
                child = node.children[t] = _Node(node, t)
                self.num_tokens += 1
            child.last_used = now
            node = child
        if self.num_tokens > self.max_tokens:
            self._evict(self.num_tokens - self.max_tokens)

    def _evict(self, count: int) -> None:
        """Drop `count` tokens, least recently used leaves first (a parent is used at least as
        recently as its children, so a stale branch goes before the prefix it hangs from)."""
        heap = [(n.last_used, id(n), n) for n in self._nodes() if not n.children]
        heapq.heapify(heap)
        while count > 0 and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.token]
            self.num_tokens -= 1
            count -= 1
            if parent is not self.root and not parent.children:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node is not self.root:
                yield node
            stack.extend(node.children.values())


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache_aware"
    """"cache_aware" (longest cached prefix, balanced by load; sessions stick) or "round_robin"
    (the baseline: replicas in turn, whatever the prompt or session)."""
    balance_threshold: int = 8
    """Cache-aware: leave the best-matching replica when its in-flight requests exceed the least
    loaded replica's by more than this."""
    tree_tokens: int = 1 << 20
    """Cache-aware: tokens each replica's prefix tree holds before dropping its LRU leaves."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"RouterConfig.policy={self.policy!r}: choose one of {POLICIES}")
        if not isinstance(self.balance_threshold, int) or self.balance_threshold < 0:
            raise ValueError(
                f"RouterConfig.balance_threshold={self.balance_threshold!r}: must be an int >= 0"
            )
        if not isinstance(self.tree_tokens, int) or self.tree_tokens < 1:
            raise ValueError(f"RouterConfig.tree_tokens={self.tree_tokens!r}: must be an int >= 1")


class Router:
    """Thread-safe routing state over `num_replicas` replicas."""

    def __init__(self, num_replicas: int, config: RouterConfig = RouterConfig()):
        if num_replicas < 1:
            raise ValueError(f"num_replicas={num_replicas}: need at least one replica")
        self.config = config
        self.num_replicas = num_replicas
        self.trees = [PrefixTree(config.tree_tokens) for _ in range(num_replicas)]
        self.load = [0] * num_replicas
        self.sessions: dict[str, int] = {}
        self._next = 0
        self._lock = threading.Lock()

    def choose(self, token_ids: Sequence[int], session_id: str | None = None) -> int:
        """The replica for a request with prompt `token_ids` (its prompt is remembered there)."""
        with self._lock:
            if self.config.policy == "round_robin":  # the baseline knows no sessions
                replica = self._next
                self._next = (self._next + 1) % self.num_replicas
            elif session_id is not None and session_id in self.sessions:
                replica = self.sessions[session_id]
            else:
                replica = self._cache_aware(token_ids)
            if session_id is not None and self.config.policy == "cache_aware":
                self.sessions[session_id] = replica
            self.trees[replica].insert(token_ids)
            return replica

    def _cache_aware(self, token_ids: Sequence[int]) -> int:
        # least loaded; among equals the one whose tree holds least (most room in its cache)
        least = min(
            range(self.num_replicas), key=lambda i: (self.load[i], self.trees[i].num_tokens, i)
        )
        matches = [tree.match(token_ids) for tree in self.trees]
        best = max(range(self.num_replicas), key=lambda i: (matches[i], -self.load[i], -i))
        if matches[best] == 0 or self.load[best] - self.load[least] > self.config.balance_threshold:
            return least
        return best

    def start_batch(self, prompts: Sequence[Sequence[int]]) -> int:
        """The replica for a batch that travels together (`choose` for its first prompt; every
        prompt then remembered there), counted as started: `finished` once it returns."""
        replica = self.choose(prompts[0])
        for prompt in prompts[1:]:
            self.record(replica, prompt)
        self.started(replica)
        return replica

    def record(self, replica: int, token_ids: Sequence[int]) -> None:
        """What `replica` now caches after serving a request: its prompt + completion ids."""
        with self._lock:
            self.trees[replica].insert(token_ids)

    def started(self, replica: int) -> None:
        with self._lock:
            self.load[replica] += 1

    def finished(self, replica: int) -> None:
        with self._lock:
            self.load[replica] -= 1

    def forget_session(self, session_id: str) -> None:
        with self._lock:
            self.sessions.pop(session_id, None)
