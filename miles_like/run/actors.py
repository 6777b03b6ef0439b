"""`RunActors`: the run's trainer ranks and engine replicas, and every call the loops make on
them. `bringup.start` creates them.

Each call is one phase of DESIGN.md's step, spelled out in the loop: the engines release the
device (`release_engines`) and the trainer takes it (`onload_trainer`) before anything the
trainer computes. After training the device changes hands in stages, so that the peak is never
the whole trainer plus the whole engine: the trainer offloads its optimizer state
(`offload_trainer_optimizer`), the engines take their weights back (`resume_engine_weights`),
the weights are pushed (`push_weights`), the trainer offloads its weights
(`offload_trainer_weights`), and only then do the engines allocate their KV cache
(`alloc_engine_kv`), sized from what is free at that point. A memory call does nothing where the
placement has nothing to hand over: engines release and resume only when they share the
trainer's devices; the trainer offloads and onloads only when that is on GPUs
(`Layout.staged_memory`).

Every wait on the actors goes through `calls.wait_all` with `cluster.call_timeout_s`. An engine
that dies during a rollout is replaced (`restart_engine`); any other actor death raises
`calls.ActorDied` for the loop to stop the run.

A mixture of experts' routes (routing replay) go to each trainer rank only for the samples it
trains on (`trainer_worker.route_shares`); the rest of the batch is put once for all ranks.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import ray

from miles_like.errors import RunFailed
from miles_like.models.store import write_model_files
from miles_like.rollouts.sample_routes import nbytes
from miles_like.run import placement
from miles_like.run.calls import ActorDied, Call, start_call, start_on_all, wait_all
from miles_like.run.trainer_worker import route_shares
from trainer.tensor_lists import unpack


class RunActors:
    """`replicas`: every rank of every engine replica, rank 0 first; `engines` are their rank 0s,
    which stand for the replica in every call but the resharding sync (the rollouts share this list:
    a replaced engine is theirs too). `push`: the weight push strategy (`weight_push`), holding the
    same lists. `model_files`: the model's config and tokenizer files, kept in memory (the directory
    may be deleted: `checkpoint.keep_last`). `reference_dir`: the frozen reference's weights (runs
    with a KL term; None without). `front`: the HTTP router in front of the engines
    (`rollout.serve_http`), or None. `replay_routes`: the engines return a mixture's routes,
    which the trainer replays (`algorithm.routing_replay`)."""

    def __init__(
        self,
        recipe,
        layout: placement.Layout,
        pg,
        tag: str,
        trainers: list,
        replicas: list[list],
        push,
        model_files: dict,
        reference_dir: Path | None,
        weight_version: int,
        log=print,
        replay_routes: bool = False,
    ):
        self.recipe, self.layout, self.pg, self.tag, self.log = recipe, layout, pg, tag, log
        self.timeout_s = recipe.cluster.call_timeout_s
        self.trainers, self.replicas = trainers, replicas
        self.engines = [ranks[0] for ranks in replicas]
        self.push = push
        self.front = None  # set by bring-up with `rollout.serve_http`
        self.model_files, self.reference_dir = model_files, reference_dir
        self.weight_version = weight_version  # of the weights in the engines
        self.sync_bytes_per_rank = 0.0  # the last push's: the most one trainer rank sent
        self.engine_restarts = 0
        self.replay_routes = replay_routes
        self.route_bytes = 0  # the last train call's: route bytes sent to the trainer ranks
        self.route_tokens = 0  # and the tokens those routes are for (one row per token)
        self._dp_places: list[tuple[int, int]] | None = None  # per rank: (DP rank, DP size)

    # ---------------------------------------------------------------------------- waiting
    def on_trainers(self, method: str, *args):
        """`method` on every trainer rank (they hold collectives); rank 0's result."""
        calls = start_on_all("trainer rank", self.trainers, method, *args)
        return wait_all(calls, self.timeout_s)[0]

    def on_engines(self, method: str, *args) -> list:
        return wait_all(start_on_all("engine", self.engines, method, *args), self.timeout_s)

    # ------------------------------------------------------------------------------ memory
    def release_engines(self) -> None:
        """Colocated: the engines give the devices to the trainer (KV cache; weights on GPU)."""
        if self.layout.colocated:
            self.on_engines("release")

    def onload_trainer(self) -> None:
        """On GPUs shared with the engines: the trainer's state back onto the devices."""
        if self.layout.staged_memory:
            self.on_trainers("onload")

    def resume_engines(self) -> None:
        """Colocated: the engines take all their memory back at once (a TP replica's rank 0
        returns once every rank of it has). The loop stages it instead: `resume_engine_weights`,
        then `alloc_engine_kv`."""
        if self.layout.colocated:
            self.on_engines("resume")

    def offload_trainer(self) -> None:
        """On GPUs shared with the engines: all the trainer's state to host memory (the loop
        stages it: `offload_trainer_optimizer`, then `offload_trainer_weights`)."""
        if self.layout.staged_memory:
            self.on_trainers("offload", "all")

    def offload_trainer_optimizer(self) -> None:
        """On GPUs shared with the engines: what the push does not read (gradients, fp32
        masters, optimizer state, the critic) to host memory, before the engines' weights
        return."""
        if self.layout.staged_memory:
            self.on_trainers("offload", "optimizer")

    def resume_engine_weights(self) -> None:
        """Colocated: the engines' weight storage back, for the push (no KV cache yet)."""
        if self.layout.colocated:
            self.on_engines("resume_weights")

    def offload_trainer_weights(self) -> None:
        """On GPUs shared with the engines: the pushed weights to host memory."""
        if self.layout.staged_memory:
            self.on_trainers("offload", "weights")

    def alloc_engine_kv(self) -> list[dict | None]:
        """Colocated: the engines' KV cache back, each sized from its device's free memory
        now that the trainer has left it; their sizings (`Engine.alloc_kv`), [] otherwise.
        An engine found dead here gets None: the next rollout finds it dead too and replaces
        it (`restart_engine`, counted in `rollout/engine_restarts`), and a replacement sizes
        its KV cache as it starts."""
        if not self.layout.colocated:
            return []
        sizings: list[dict | None] = []
        for call in start_on_all("engine", self.engines, "alloc_kv"):
            try:
                sizings.append(wait_all([call], self.timeout_s)[0])
            except ActorDied:
                sizings.append(None)
        return sizings

    # ------------------------------------------------------------------------- trainer calls
    def values(self, batch_ref) -> list:
        """The critic's per-token values of a batch (`ray.put`)."""
        return unpack(self.on_trainers("values", batch_ref))

    def ref_logprobs(self, batch_ref) -> list:
        """The frozen reference's per-token log-probs of a batch (`ray.put`)."""
        return unpack(self.on_trainers("ref_logprobs", batch_ref))

    def train(self, batch) -> dict[str, float]:
        """Policy (and critic) updates on one rollout batch."""
        return self.finish_train(self.start_train(batch))

    def start_train(self, batch) -> list[Call]:
        """`train`'s calls, started (the trainer ranks run them in call order); the caller may
        do other work before `finish_train` waits for them. Rank 0's policy call is first.
        The batch is put once; its routes, if any, go to each rank for its own samples."""
        routes = batch.routed_experts
        ref = ray.put(batch if routes is None else dataclasses.replace(batch, routed_experts=None))
        updates = self.recipe.trainer.updates_per_rollout
        per_rank = self._routes_per_rank(routes, updates)
        self.route_bytes = sum(nbytes(r) for mine in per_rank if mine for r in mine)
        self.route_tokens = sum(len(r) for mine in per_rank if mine for r in mine if r is not None)
        calls = [
            start_call(f"trainer rank {i}", t, "train", ref, updates, mine)
            for i, (t, mine) in enumerate(zip(self.trainers, per_rank))
        ]
        if batch.returns is not None:
            calls += start_on_all("trainer rank", self.trainers, "train_critic", ref, updates)
        return calls

    def _routes_per_rank(self, routes, updates: int) -> list[list | None]:
        """Per trainer rank, the routes of the samples it trains on, None elsewhere (None: no
        routes at all)."""
        if routes is None:
            return [None] * len(self.trainers)
        if self._dp_places is None:
            calls = start_on_all("trainer rank", self.trainers, "data_parallel_place")
            self._dp_places = [tuple(p) for p in wait_all(calls, self.timeout_s)]
        shares = route_shares(len(routes), updates, self._dp_places[0][1])
        out = []
        for dp_rank, _ in self._dp_places:
            mine = set(shares[dp_rank])
            out.append([r if i in mine else None for i, r in enumerate(routes)])
        return out

    def route_metrics(self) -> dict[str, float]:
        """`rollout/route_bytes` and `rollout/route_tokens` with routing replay: the last train
        call's route bytes and the tokens they route, summed over the trainer ranks."""
        if not self.replay_routes:
            return {}
        return {"route_bytes": float(self.route_bytes), "route_tokens": float(self.route_tokens)}

    def finish_train(self, calls: list[Call]) -> dict[str, float]:
        ranks = len(self.trainers)
        metrics = wait_all(calls[:ranks], self.timeout_s)[0]
        if calls[ranks:]:  # the critic's (each wait has its own call_timeout_s)
            critic = wait_all(calls[ranks:], self.timeout_s)[0]
            metrics.update({f"critic_{k}": v for k, v in critic.items()})
        return metrics

    def save_hf(self, directory: Path) -> None:
        """The policy as a Hugging Face directory: weights from the trainer, config and
        tokenizer files from the model's."""
        self.on_trainers("save_hf", str(directory))
        write_model_files(self.model_files, directory)

    # -------------------------------------------------------------------------- engine calls
    def push_weights(self, in_place: bool = False) -> float:
        """The trainer's weights into every engine (colocated: their weights resumed first,
        `resume_engine_weights`). Returns the bytes sent; `sync_bytes_per_rank` is the most one
        trainer rank sent. `in_place`: see `weight_push`."""
        reports = self.push.push(in_place)
        self.weight_version += 1
        self.sync_bytes_per_rank = max(r["bytes"] for r in reports)
        return sum(r["bytes"] for r in reports)

    def flush_prefix_caches(self) -> None:
        """Empty every engine's prefix cache (a weight push does it too), so that every rollout
        starts from an empty cache: what a resumed run's fresh engines have."""
        self.on_engines("flush_prefix_cache")

    def set_engines_version(self) -> None:
        """A resumed run: the engines hold weights of the checkpoint's `weight_version`."""
        self.on_engines("set_weight_version", self.weight_version)

    def restart_engine(self, index: int, died: BaseException | None = None):
        """Replace dead engine `index` by a new actor in the same bundles, loaded with the
        trainer's current weights (written to a scratch HF directory), at the current weight
        version; disaggregated, every member rejoins a new broadcast group. Returns it.
        Past `cluster.max_engine_restarts` replacements in this run it raises `RunFailed`
        instead, naming `died` (what the caller saw) and the field."""
        budget = self.recipe.cluster.max_engine_restarts
        if self.engine_restarts >= budget:
            raise RunFailed(
                f"{died or f'engine {index} died'}; cluster.max_engine_restarts={budget} "
                "replacements made already in this run; raise it, or resume with "
                "checkpoint.resume=auto"
            )
        self.engine_restarts += 1
        for rank in self.replicas[index]:  # one rank is dead: make sure every rank's are free
            ray.kill(rank)
        scratch = Path(self.recipe.tracking.output_dir) / f".engine-restart-{self.tag}"
        shutil.rmtree(scratch, ignore_errors=True)
        try:
            self.save_hf(scratch)
            (ranks,) = placement.create_engines(
                self.layout,
                self.pg,
                placement.engine_settings(self.recipe, self.layout, scratch),
                [placement.engine_name(self.tag, index, self.engine_restarts)],
                self.timeout_s,
                indices=[index],
                return_routes=self.replay_routes,
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.replicas[index] = ranks
        engine = self.engines[index] = ranks[0]
        if self.front is not None:
            self.front.replace(index, engine)
        wait_all(
            [start_call(f"engine {index}", engine, "set_weight_version", self.weight_version)],
            self.timeout_s,
        )
        self.push.join()
        return engine

    # ------------------------------------------------------------------------------- the end
    def shutdown(self, graceful: bool = True) -> None:
        """Release every actor and the placement group. `graceful` first lets the trainer
        ranks leave their process group; after a failure it is skipped (a surviving rank may be
        blocked in a collective with a dead one)."""
        if graceful:
            try:
                wait_all(
                    start_on_all("trainer rank", self.trainers, "shutdown"),
                    min(self.timeout_s, 60),
                )
            except Exception:  # shutting down after a failure: the actors may be gone already
                pass
        if self.front is not None:
            self.front.close()
        placement.release(self.pg, self.trainers + [a for ranks in self.replicas for a in ranks])
