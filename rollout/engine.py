"""The engine: model + paged KV pool + radix cache + continuous-batching scheduler.

Usable on its own as a generation library (`Engine.generate`), and driven by the RL controller
through its lifecycle calls: `update_weights` after every training step, `release_memory` /
`resume_memory` around the training phase when trainer and engine share a device.
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import torch
import torch.distributed as dist

from rollout import device_memory
from rollout.activity import ActivityLog, ForwardPass
from rollout.build import KVSizing, build_parts, kv_sizing, replica_group
from rollout.config import EngineConfig, SamplingParams
from rollout.handoff import PrefillHandoff, transfer
from rollout.kv_calibration import calibrate_kv_scales
from rollout.model_runner import execute
from rollout.sequence import Request, RequestOutput, SampleOutput, StopCheck
from rollout.tp_group import (
    CalibrateKV,
    Forward,
    GatherKV,
    LoadWeights,
    Release,
    Resume,
    Stop,
)
from rollout.weights import WeightStatus, copy_into, load_weights, piece_target


class Engine:
    def __init__(self, config: EngineConfig, tp_group: dist.ProcessGroup | None = None):
        """`tp` > 1: this process is rank 0 of the replica's `tp_group` (default:
        the whole torch.distributed world); the other ranks run `rollout.tp_follower`."""
        self.config = config
        self.tp = replica_group(config, tp_group)
        parts = build_parts(config, self.tp)  # rollout.build: where the switches meet
        self.model, self.model_config = parts.model, parts.model_config
        self.max_model_len, self._shards = parts.max_model_len, parts.shards
        self.device, self.dtype = torch.device(config.device), getattr(torch, config.dtype)
        self.eos_token_ids = parts.eos_token_ids
        self.pool, self.scheduler, self.runner = parts.pool, parts.scheduler, parts.runner
        self.kv_sizing = parts.kv_sizing  # how the KV pool was last sized
        self.draft_model = parts.draft_model  # None unless speculative_method="draft"
        self.suffix_lanes, self.decode_graphs = parts.suffix_lanes, parts.decode_graphs

        self.weight_version = 0
        self._param_shapes = {n: p.shape for n, p in self.model.named_parameters()}
        self._weights = WeightStatus(self._param_shapes)  # generation waits while invalid
        self._params_by_name: dict[str, torch.Tensor] | None = None  # during an update
        self._next_request_id = 0
        self._seed_rng = random.Random(config.seed)
        self._abort_lock = threading.Lock()
        self._pending_aborts: set[int] = set()
        # Seconds in forward passes (model forward + sampling) and their count, always kept;
        # each pass's interval too while an owner has attached a log (they drain it).
        self.busy_s = 0.0
        self.forward_passes = 0
        self.activity: ActivityLog | None = None
        if self.tp is not None:  # a prefill handoff carries every rank's KV heads
            self.scheduler.read_kv = self._gather_kv
        self._calibrate_kv()

    # -- requests ------------------------------------------------------------------------------
    def _check_ready(self) -> None:
        if not self.pool.allocated:
            raise RuntimeError("engine memory is released; call resume_memory() before generating")
        self._weights.check()

    def add_request(
        self,
        prompt_token_ids: Seq[int],
        params: SamplingParams,
        stop_check: StopCheck | None = None,
    ) -> int:
        """Queue one prompt; returns its request id. Outputs come from `step()`. `stop_check`
        (e.g. stop strings) sees each sample's generated ids after every token it samples."""
        self._check_ready()
        prompt = [int(t) for t in prompt_token_ids]
        check_request(prompt, params, self)
        request_id = self._next_request_id
        self._next_request_id += 1
        base_seed = params.seed if params.seed is not None else self._seed_rng.randrange(2**62)
        self.scheduler.add(Request(request_id, prompt, params, base_seed, stop_check))
        return request_id

    def admit_prefilled(
        self, handoff: PrefillHandoff, params: SamplingParams, stop_check: StopCheck | None = None
    ) -> int:
        """Queue a request another engine prefilled (`rollout.prefill_decode.prefill`, with these
        `params`); returns its request id. It decodes from the next `step()`, which returns it."""
        self._check_ready()
        prompt = list(handoff.prompt_token_ids)
        check_request(prompt, params, self)
        handoff.check(
            params,
            self.weight_version,
            self.model_config.num_kv_heads,
            self.draft_model is not None,
        )
        request_id = self._next_request_id
        self._next_request_id += 1
        request = Request(request_id, prompt, params, handoff.base_seed, stop_check)
        self.scheduler.add_prefilled(request, transfer(handoff, self.device))
        return request_id

    def _gather_kv(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Under tensor parallelism: K, V of `slots`, every rank's KV heads (`GatherKV`). The
        other ranks first replay the pool operations not sent yet (a fork's page copy)."""
        ops, self.pool.copy_log[:] = tuple(self.pool.copy_log), []
        self.tp.send(GatherKV(slots, ops))
        k, v = self.pool.read_slots(slots)
        return self.tp.gather_heads(k), self.tp.gather_heads(v)

    def abort(self, request_id: int) -> None:
        """Stop a request (safe from another thread); its unfinished samples end with
        finish_reason "abort" and the tokens they had."""
        with self._abort_lock:
            self._pending_aborts.add(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One scheduling step and forward pass; returns the requests that finished."""
        with self._abort_lock:
            aborts, self._pending_aborts = self._pending_aborts, set()
        for request_id in aborts:
            self.scheduler.abort(request_id)
        if self.scheduler.running or self.scheduler.waiting:
            self._weights.check()
        self.scheduler.weight_version = self.weight_version
        batch = self.scheduler.schedule()
        if not batch.empty:
            start, finished_before = time.time(), self.scheduler.stats.finished_samples
            if self.decode_graphs is not None and self.decode_graphs.accepts(batch):
                logits = self.decode_graphs.run(batch.decode)
            elif self.tp is not None:
                plan = self.runner.prepare(batch)
                copies, self.pool.copy_log[:] = tuple(self.pool.copy_log), []
                self.tp.send(Forward(plan, copies))
                logits = execute(self.model, self.runner.attention, plan)
            else:
                logits = self.runner.run(batch)
            self.scheduler.finish_step(batch, logits)
            end = time.time()  # sampling read the tokens back: the device work is done
            self.busy_s += end - start
            self.forward_passes += 1
            if self.activity is not None:
                sequences = len(batch.decode) + len(batch.prefill)
                finished = self.scheduler.stats.finished_samples - finished_before
                self.activity.record(ForwardPass(start, end, sequences, finished))
        elif self.scheduler.waiting:
            raise RuntimeError("scheduler made no progress with requests waiting (engine bug)")
        return self.scheduler.pop_finished()

    def generate(
        self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]
    ) -> list[list[SampleOutput]]:
        """Generate for every prompt; result[i][j] is sample j of prompt i."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts; "
                "give one or one per prompt"
            )
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        wanted = set(ids)
        results: dict[int, list[SampleOutput]] = {}
        while wanted - results.keys():
            for out in self.step():
                if out.request_id in wanted:
                    results[out.request_id] = out.samples
        return [results[i] for i in ids]

    # -- RL lifecycle --------------------------------------------------------------------------
    def _require_idle(self, what: str) -> None:
        if self.has_unfinished():
            raise RuntimeError(f"{what} while requests are in flight; finish or abort them first")

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], keep_running: bool = False
    ) -> None:
        """Copy (hf_name, tensor) pairs into the model in place (addresses unchanged), flush the
        prefix cache (its K/V came from the old weights) and bump `weight_version`. A partial set
        is allowed; after `release_memory(weights=True)` generation waits until every weight has
        arrived again. Same as `load_weights` followed by `commit_weights`.

        `keep_running`: requests may be in flight (call it between two `step`s, never during
        one; `AsyncEngine.update_weights_between_steps` does). They keep their K/V, computed by
        the old weights (`in_place`, as in AReaL), and sample on with the new ones; each token
        records the version that sampled it (`SampleOutput.weight_versions`). No request
        admitted afterwards is served K/V of the old weights (`Scheduler.new_weights`)."""
        self.load_weights(named_tensors, keep_running=keep_running)
        self.commit_weights()

    def load_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        all_ranks: bool = True,
        keep_running: bool = False,
    ) -> None:
        """The first half of a (possibly bucketed) update: copy in place, commit later. Generation
        refuses until `commit_weights`. If loading fails midway the model is a mix of old and new
        weights, so generation then waits for a complete set.

        Under TP, `all_ranks` sends the tensors (full, or pre-sharded for rank 0 only when
        False) to every rank; `all_ranks=False` loads rank 0's own shards only, the other ranks
        loading theirs themselves (`EngineFollower.load_weights`: the resharding sync).

        `keep_running` (see `update_weights`): no `step` may run until `commit_weights`. Under
        TP only with `all_ranks`: the followers then load in the order of rank 0's commands,
        between the same two forward passes; their own shards arrive outside that order."""
        if not keep_running:
            self._require_idle("load_weights")
        elif self.tp is not None and not all_ranks and self.has_unfinished():
            raise RuntimeError(
                "load_weights(keep_running=True, all_ranks=False) while requests run under "
                "tensor parallelism: the followers' own shards would land during a forward "
                "pass; send full tensors (all_ranks=True) or finish the requests first"
            )
        self._weights.uncommitted = True
        if self.tp is not None and all_ranks:  # every rank takes its slice of the same tensors
            named_tensors = list(named_tensors)
            self.tp.send(LoadWeights(named_tensors))
        try:
            loaded = load_weights(
                self.model,
                named_tensors,
                tied_embeddings=self.model_config.tie_word_embeddings,
                require_all=False,
                shards=self._shards,
                params=self._update_params(),
            )
        except BaseException:
            self._weights.invalidate()
            raise
        self._weights.record(loaded)

    def load_weight_piece(
        self,
        name: str,
        shape: tuple[int, ...],
        start: int,
        piece: torch.Tensor,
        keep_running: bool = False,
    ) -> bool:
        """Part of `load_weights` for a tensor sent in pieces (`weight_sync`'s split tensors):
        copy `piece` (1-D) into elements [start, start + numel) of weight `name` (whole `shape`)
        in place, if this engine holds that weight exactly as sent (same shape and dtype,
        contiguous, on `piece`'s device, no TP slice): then returns True, and the weight counts
        as loaded once its last element is in. Returns False, writing nothing, otherwise (the
        caller assembles the whole tensor and calls `load_weights`); the answer depends on the
        name, shape, dtype and device only. Commit with `commit_weights`."""
        if self.tp is not None:
            return False
        target = piece_target(
            self._update_params(),
            name,
            shape,
            piece.dtype,
            tied_embeddings=self.model_config.tie_word_embeddings,
        )
        if target is None or target[1].device != piece.device:
            return False
        if not keep_running:
            self._require_idle("load_weight_piece")
        target_name, flat = target
        if not 0 <= start <= start + piece.numel() <= flat.numel():
            raise ValueError(
                f"piece of {name!r} at elements [{start}, {start + piece.numel()}) is outside "
                f"its {flat.numel()} elements"
            )
        self._weights.uncommitted = True
        copy_into(flat[start : start + piece.numel()], piece.reshape(-1))
        if start + piece.numel() == flat.numel():
            self._weights.record({target_name})
        return True

    def _update_params(self) -> dict[str, torch.Tensor]:
        """The model's parameters by name, looked up once per update (an update of small
        buckets loads many times; nothing replaces a parameter while it runs)."""
        if self._params_by_name is None:
            self._params_by_name = dict(self.model.named_parameters())
        return self._params_by_name

    def commit_weights(self) -> None:
        """Finish an update: flush the prefix cache (retire it while requests run:
        `Scheduler.new_weights`) and bump `weight_version`."""
        if self.scheduler.cache is not None and self.pool.allocated:
            self.scheduler.new_weights()
        self._calibrate_kv()
        # idle (no keep_running) nothing runs: 0
        self.scheduler.stats.in_place_kept_tokens += sum(
            s.num_computed for s in self.scheduler.running
        )
        self.weight_version += 1
        self._weights.uncommitted = False
        self._params_by_name = None

    def _calibrate_kv(self) -> None:
        """An FP8 KV pool's scales from the weights now loaded (`rollout.kv_calibration`), once
        the weights are complete (after a release, the update that completes them calibrates).
        K/V kept across the update (running with `keep_running`, or parked) are re-quantized
        to the new scales; the suffix lanes, copies of the old values, are refilled."""
        if not self.pool.quantized or not self._weights.complete:
            return
        if self.tp is not None:  # every rank calibrates its own KV heads, together
            self.tp.send(CalibrateKV())
        self.pool.set_scales(*calibrate_kv_scales(self.model))
        if self.suffix_lanes is not None:
            self.suffix_lanes.forget()

    def cached_prefix_lengths(self, prompts: Seq[Seq[int]]) -> list[int]:
        """How many leading tokens of each prompt admitting it now would take from the prefix
        cache (never its last token, whose logits are needed: `PageAllocator.take_prefix`),
        read without changing the cache (`RadixCache.cached_prefix_length`). Call it between
        steps (`AsyncEngine.hold`) when a step loop runs."""
        cache = self.scheduler.cache
        if cache is None or not self.pool.allocated:
            return [0] * len(prompts)
        return [cache.cached_prefix_length(list(p[:-1])) for p in prompts]

    def flush_prefix_cache(self) -> int:
        """Drop every cached prefix and parked K/V (nothing may be in flight). Returns the pages
        freed."""
        self._require_idle("flush_prefix_cache")
        if self.scheduler.cache is None or not self.pool.allocated:
            return 0
        freed = self.scheduler.drop_parked()
        return freed + self.scheduler.new_weights()

    def release_memory(self, weights: bool = False) -> int:
        """Free the KV pool (and, with `weights`, the parameters' storage) and hand it back to the
        device (`device_memory.return_freed`), for the trainer's process. Returns the bytes
        released. Static decode steps survive a KV-only release (`DecodeGraphs.revalidate`);
        released weights drop them, re-built later (`stats()["graph_captures"]` counts)."""
        self._require_idle("release_memory")
        weights = weights and self._weights.complete
        if self.tp is not None:
            self.tp.send(Release(weights))
            self.tp.barrier()  # returns once every rank has freed it too
        released = 0
        if self.pool.allocated:
            self.scheduler.drop_parked()
            if self.scheduler.cache is not None:
                self.scheduler.new_weights()
            released += 2 * self.pool.k.numel() * self.pool.k.element_size()
            self.pool.free_memory()
            if self.suffix_lanes is not None:
                self.suffix_lanes.release()
        if self.draft_model is not None:
            released += self.draft_model.release()
        # Plans kept from the last steps hold their tensors (a graph capture's, too).
        self.runner.forget_plan()
        if weights:
            if self.decode_graphs is not None:  # graphs hold the parameters' addresses
                self.decode_graphs.reset()
            released += self.model.release_storage()
            self._weights.invalidate()
        device_memory.return_freed(self.device)
        return released

    def resume_memory(self) -> None:
        """Re-create what `release_memory` freed: `resume_weights`, then `alloc_kv`."""
        self.resume_weights()
        self.alloc_kv()

    def resume_weights(self) -> None:
        """The parameters' storage back, uninitialised, ready for the weight push (the next
        `update_weights` fills it; generation waits until it has). The KV pool stays released:
        colocated, the trainer still holds its weights until the push is done (`alloc_kv`)."""
        if self.tp is not None:
            self.tp.send(Resume(weights=True, kv=False))
            self.tp.barrier()  # every rank's too: the resharding sync may send them their shards
        self.model.restore_storage(self._param_shapes)
        if self.decode_graphs is not None:
            self.decode_graphs.revalidate()

    def alloc_kv(self) -> KVSizing:
        """The KV pool (and the draft model's) back, with `kv_cache_tokens` unset sized now from
        the free memory (colocated: what the offloaded trainer left). Returns `kv_sizing`."""
        if self.tp is not None:
            self.tp.send(Resume(weights=False, kv=True))
        if not self.pool.allocated:
            self.kv_sizing = kv_sizing(self.config, self.model_config, self.max_model_len, self.tp)
            self.pool.allocate(self.kv_sizing.pages)
        if self.draft_model is not None:
            self.draft_model.resume()
        if self.decode_graphs is not None:
            self.decode_graphs.revalidate()
        if self.tp is not None:
            self.tp.barrier()
        return self.kv_sizing

    def close(self) -> None:
        """Under tensor parallelism: tell the other ranks to stop serving (their `run_rank`
        returns). Nothing to do without TP."""
        if self.tp is not None:
            self.tp.send(Stop())
            self.tp = None

    # -- introspection -------------------------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        s = dataclasses.asdict(self.scheduler.stats)
        cache = self.scheduler.cache
        s.update(
            weight_version=self.weight_version,
            kv_pool_tokens=self.pool.num_slots,
            kv_free_tokens=self.pool.num_free_pages * self.pool.page_size,
            prefix_cache_tokens=(cache.cached_pages * self.pool.page_size)
            if cache is not None
            else 0,
            running_sequences=len(self.scheduler.running),
            parked_kv_tokens=sum(p.num_computed for p in self.scheduler.parked),
            busy_s=self.busy_s,
            forward_passes=self.forward_passes,
            waiting_sequences=len(self.scheduler.waiting),
            graph_captures=self.decode_graphs.captures if self.decode_graphs is not None else 0,
            kv_fp8_clipped_share=self.pool.clipped_share(),
        )
        return s

    def check_integrity(self) -> None:
        """Assert the KV bookkeeping invariants (free + cached + in use == total, locks, rows),
        that every suffix lane equals the pool's K/V it copies, and that an FP8 pool with complete
        weights has calibrated (finite) scales."""
        if self.pool.quantized and self._weights.complete:
            assert (
                torch.isfinite(self.pool.k_scale).all() and torch.isfinite(self.pool.v_scale).all()
            )
        if self.pool.allocated:
            self.scheduler.check_integrity()
            if self.suffix_lanes is not None:
                self.suffix_lanes.check(self.scheduler.running)
            if self.draft_model is not None:
                self.draft_model.check_integrity()


def check_request(prompt: list[int], params: SamplingParams, engine: Engine) -> None:
    """The user errors of one request on `engine`, each one line naming what to change."""
    vocab, page_size = engine.model_config.vocab_size, engine.config.page_size
    if not prompt:
        raise ValueError("prompt_token_ids is empty; give at least one token")
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt_token_ids has ids outside the vocabulary [0, {vocab})")
    total = len(prompt) + params.max_new_tokens
    if total > engine.max_model_len:
        raise ValueError(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({params.max_new_tokens}) = "
            f"{total} exceeds max_model_len={engine.max_model_len}; shorten the prompt or lower "
            "max_new_tokens"
        )
    pages = -(-total // page_size)
    if pages > engine.pool.num_pages:
        raise ValueError(
            f"one sequence of {total} tokens needs {pages * page_size} KV slots but "
            f"kv_cache_tokens holds {engine.pool.num_slots}; raise kv_cache_tokens"
        )
    if params.n > engine.config.max_running_requests:
        raise ValueError(
            f"SamplingParams.n={params.n} exceeds max_running_requests="
            f"{engine.config.max_running_requests}; raise max_running_requests"
        )
