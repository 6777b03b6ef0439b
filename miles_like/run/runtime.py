"""Everything the RL loop drives, set up from a recipe (or a checkpoint): Ray placement, the
trainer ranks (after the optional warm start), the engine replicas, the prompt source, the reward
function and the rollout manager; plus the multi-actor calls the loop makes (train, weight sync,
memory phases, checkpoint writes, engine restarts).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import uuid
from pathlib import Path

import ray

from miles_like.data import PromptSource
from miles_like.errors import RecipeError, RunFailed
from miles_like.models.store import base_model_dir, read_model_files, write_model_files
from miles_like.models.tokenizer import load_tokenizer
from miles_like.recipe.build_configs import critic_config, engine_config, trainer_config
from miles_like.rollouts.functions import resolve_rollout_function
from miles_like.rollouts.manager import RolloutManager
from miles_like.run import checkpoint, placement
from miles_like.run.calls import Call, call, each, gather
from miles_like.run.http_front import HttpFront
from miles_like.run.warm_start import warm_start
from miles_like.scoring.rewards import resolve_reward
from trainer.tensor_lists import unpack
from weight_sync import DEFAULT_BUCKET_BYTES

MIB = 1 << 20


def _subdir(directory: Path, name: str) -> Path | None:
    return directory / name if (directory / name).is_dir() else None


def _trainer_layout(recipe, ranks: int) -> dict:
    """What a resumed run must match for the per-rank training states to fit."""
    tr = recipe.trainer
    return {"trainer_ranks": ranks, "tp": tr.tp, "pp": tr.pp, "backend": tr.backend}


def _check_same_layout(recipe, state: dict, ranks: int) -> None:
    now = _trainer_layout(recipe, ranks)
    then = {k: state[k] for k in now}
    if now != then:
        raise RecipeError(
            f"checkpoint.resume: the checkpoint was written with {then}, this "
            f"recipe gives {now}; resume with the same cluster.devices, "
            "cluster.rollout_devices and trainer.tp / pp / backend"
        )


def _bucket_bytes(model_dir: Path) -> int:
    """Sync buckets no larger than the model: a tiny model does not map 2 x 512 MiB."""
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return int(min(DEFAULT_BUCKET_BYTES, max(MIB, math.ceil(size / MIB) * MIB)))


class Runtime:
    """`resume`: a complete checkpoint directory (`checkpoint.py`) whose weights and training
    state the actors start from instead of the model / warm start; `state` its state.json.

    Every wait on the actors goes through `calls.gather` with `cluster.call_timeout_s`. An
    engine that dies during a rollout is replaced (`restart_engine`); any other actor death
    raises `calls.ActorDied` for the loop to stop the run."""

    def __init__(self, recipe, log=print, resume: Path | None = None, state: dict | None = None):
        self.recipe = recipe
        self.log = log
        self.timeout_s = recipe.cluster.call_timeout_s
        self.layout = placement.plan(recipe.cluster, recipe.rollout.tp)
        self.tag = uuid.uuid4().hex[:8]  # this run's actor names: miles_like.{tag}.*
        self.resume, self.state = resume, state
        self.weight_version = state["weight_version"] if state else 0  # syncs into the engines
        self.engine_restarts = 0
        if state is not None:
            _check_same_layout(recipe, state, len(self.layout.trainer_bundles))
        base_dir = base_model_dir(recipe.model, recipe.seed)
        try:
            self.tokenizer = load_tokenizer(base_dir)
        except ValueError as e:
            raise RecipeError(str(e)) from None
        hf = json.loads((base_dir / "config.json").read_text())
        context = min(
            hf.get("max_position_embeddings", 1 << 30), recipe.trainer.max_tokens_per_micro_batch
        )
        self.context_len, self.vocab_size = context, hf["vocab_size"]
        # imported before any actor starts: a bad module fails in seconds, not minutes
        self.rollout_fn = resolve_rollout_function(recipe.rollout.function)
        max_prompt = context - recipe.rollout.max_new_tokens
        if max_prompt < 1:
            raise RecipeError(
                f"rollout.max_new_tokens={recipe.rollout.max_new_tokens} leaves no "
                f"room for a prompt in the model's context of {context}; lower it"
            )
        # The data is read before any actor starts: a bad file fails in seconds, not minutes.
        self.source = PromptSource(
            recipe.data, self.tokenizer, seed=recipe.seed, max_prompt_tokens=max_prompt
        )
        if state is not None:
            if self.source.num_rows != state["data_rows"]:
                raise RecipeError(
                    f"data.path: {self.source.num_rows} usable rows now, "
                    f"{state['data_rows']} when the checkpoint was written; resume "
                    "with the same data"
                )
            self.source.skip_to(state["data_consumed"])
        placement.start_ray(recipe.cluster, self.layout)
        self.pg = placement.reserve(self.layout, strategy=recipe.cluster.placement_strategy)
        self.trainers, self.engines, self.replicas = [], [], []
        # colocated on GPUs: engines and trainer take turns holding the devices' memory
        self.staged_memory = self.layout.colocated and self.layout.accelerator == "cuda"
        try:
            self._start_actors(base_dir, max_prompt)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    def _start_actors(self, base_dir: Path, max_prompt: int) -> None:
        recipe, log = self.recipe, self.log
        self.trainers = placement.create_trainers(self.layout, self.pg, self.tag, self.timeout_s)
        if self.resume is None:
            self.model_dir = warm_start(
                recipe, base_dir, self.trainers, self.tokenizer, max_prompt, log=log
            )
            # the weights the run started from: the frozen reference of a KL term
            self.reference_dir: Path | None = self.model_dir
            engine_dir = self.model_dir
        else:  # every weight comes from the checkpoint: no warm start
            self.model_dir = self.resume
            self.reference_dir = _subdir(self.resume, checkpoint.REFERENCE_DIR)
            engine_dir = _subdir(self.resume, checkpoint.ENGINE_DIR) or self.resume
        # config and tokenizer files, kept in memory: the directory may be deleted (keep_last)
        self.model_files = read_model_files(self.model_dir, skip=checkpoint.OWN_FILES)
        alg = recipe.algorithm
        policy = trainer_config(recipe, str(self.model_dir))
        self.use_reference = policy.use_reference
        if policy.use_reference:
            if self.reference_dir is None:
                raise RecipeError(
                    f"checkpoint.resume: {self.resume} holds no reference model "
                    "(its run had no KL term); resume with algorithm.kl_coef and "
                    "kl_reward_coef at 0"
                )
            policy = dataclasses.replace(policy, reference_path=str(self.reference_dir))
        critic = critic_config(recipe, str(self.model_dir)) if alg.advantage == "gae" else None
        off_policy = recipe.cluster.off_policy_steps == 1
        build = each(
            "trainer rank",
            self.trainers,
            "build",
            policy,
            critic,
            alg.value_clip,
            off_policy,
            str(engine_dir) if off_policy and self.resume is not None else None,
        )
        # The engines start while the trainer ranks build (separate processes: megatron's
        # import and the engines' start-up overlap), except where an engine sizes its KV
        # cache by the free memory of a device the trainer's weights are still filling.
        if self.staged_memory and recipe.rollout.kv_cache_tokens is None:
            self._wait(build)
        # every rank of every replica; `engines` are their rank 0s, which stand for the replica
        # in every call but the resharding sync
        self.replicas = placement.create_engines(
            self.layout,
            self.pg,
            self._engine_config(engine_dir),
            [placement.engine_name(self.tag, i) for i in range(self.layout.num_replicas)],
            self.timeout_s,
        )
        self._wait(build)
        if self.resume is not None:
            self._wait(
                [
                    call(
                        f"trainer rank {rank}",
                        t,
                        "load_state",
                        str(checkpoint.rank_file(self.resume, rank)),
                    )
                    for rank, t in enumerate(self.trainers)
                ]
            )
        self.engines = [ranks[0] for ranks in self.replicas]
        # trainer TP rank r feeds engine TP rank r its own shards when the sizes match, over
        # either transport (the resharding sync)
        self.sharded_sync = (
            self.layout.engine_tp > 1
            and recipe.trainer.tp == self.layout.engine_tp
            and recipe.trainer.backend == "megatron"
        )
        self.sync_bytes_per_rank = 0.0
        if self.weight_version:
            self._on_engines("set_weight_version", self.weight_version)
        self.bucket_bytes = _bucket_bytes(self.model_dir)
        self.num_stages = recipe.trainer.pp
        if not self.layout.colocated:
            self._join_sync_group()
        self.front = (
            HttpFront(self.engines, self.tokenizer.tok, self.timeout_s)
            if recipe.rollout.serve_http
            else None
        )
        if self.front is not None:
            log(f"rollout.serve_http: OpenAI-compatible router at {self.front.base_url}")
        # shares self.engines: a replaced engine is the rollouts' too
        self.rollouts = RolloutManager(
            recipe,
            self.engines,
            self.tokenizer,
            resolve_reward(recipe.reward.function),
            self.source,
            rollout_fn=self.rollout_fn,
            context_len=self.context_len,
            vocab_size=self.vocab_size,
            restart_engine=self.restart_engine,
            log=log,
            front=self.front,
        )
        if self.state is not None:  # the partial groups the checkpoint's pending rollout continued
            self.rollouts.restore_carry(self.state.get("carried", []))

    def _engine_config(self, model_dir: Path):
        device = "cuda" if self.layout.accelerator == "cuda" else "cpu"
        return engine_config(self.recipe, str(model_dir), device)

    def _join_sync_group(self) -> None:
        """Disaggregated: the engines and the trainer's sources form the broadcast group. Its
        rank 0 is engine 0, so it meets on engine 0's node. The resharding sync has one group
        per TP rank index r (engine rank r of every replica, trainer TP rank r of every stage),
        meeting on replica 0's rank r."""
        if self.sharded_sync:
            self._join_shard_groups()
            return
        ((host, port),) = self._wait([call("engine 0", self.engines[0], "rendezvous")])
        e = len(self.engines)
        self._wait(
            [
                call(
                    f"engine {i}",
                    eng,
                    "join_sync_group",
                    host,
                    port,
                    i,
                    e,
                    self.num_stages,
                    self.timeout_s,
                )
                for i, eng in enumerate(self.engines)
            ]
            + each(
                "trainer rank",
                self.trainers,
                "join_sync_group",
                host,
                port,
                e,
                self.num_stages,
                self.timeout_s,
            )
        )

    def _join_shard_groups(self) -> None:
        k, e = self.layout.engine_tp, len(self.replicas)
        groups = self._wait(each("engine 0 rank", self.replicas[0], "rendezvous"))
        self._wait(
            [
                call(
                    f"engine {i} rank {r}",
                    ranks[r],
                    "join_sync_group",
                    *groups[r],
                    i,
                    e,
                    self.num_stages,
                    self.timeout_s,
                    True,
                )
                for i, ranks in enumerate(self.replicas)
                for r in range(k)
            ]
            + each(
                "trainer rank",
                self.trainers,
                "join_sync_group",
                None,
                None,
                e,
                self.num_stages,
                self.timeout_s,
                groups,
            )
        )

    # ---------------------------------------------------------------------------- waiting
    def _wait(self, calls: list[Call]) -> list:
        return gather(calls, self.timeout_s)

    def _on_trainers(self, method: str, *args):
        """`method` on every trainer rank (they hold collectives); rank 0's result."""
        return self._wait(each("trainer rank", self.trainers, method, *args))[0]

    def _on_engines(self, method: str, *args) -> list:
        return self._wait(each("engine", self.engines, method, *args))

    # ------------------------------------------------------------------------- trainer calls
    def values(self, batch_ref) -> list:
        return unpack(self._on_trainers("values", batch_ref))

    def ref_logprobs(self, batch_ref) -> list:
        return unpack(self._on_trainers("ref_logprobs", batch_ref))

    def train(self, batch) -> dict[str, float]:
        """Policy (and critic) updates on one rollout batch; the engines' memory is released
        first when they share the devices."""
        return self.finish_train(self.start_train(batch))

    def start_train(self, batch) -> list[Call]:
        """`train`'s calls, started (the trainer ranks run them in call order); the caller may
        do other work before `finish_train` waits for them. Rank 0's policy call is first."""
        if self.layout.colocated:
            self._on_engines("release")
        if self.staged_memory:
            self._on_trainers("onload")
        ref = ray.put(batch)
        updates = self.recipe.trainer.updates_per_rollout
        calls = each("trainer rank", self.trainers, "train", ref, updates)
        if batch.returns is not None:
            calls += each("trainer rank", self.trainers, "train_critic", ref, updates)
        return calls

    def finish_train(self, calls: list[Call]) -> dict[str, float]:
        ranks = len(self.trainers)
        metrics = self._wait(calls[:ranks])[0]
        if calls[ranks:]:  # the critic's (each wait has its own call_timeout_s)
            critic = self._wait(calls[ranks:])[0]
            metrics.update({f"critic_{k}": v for k, v in critic.items()})
        return metrics

    def sync_weights(self, in_place: bool = False) -> float:
        """Push the trainer's weights into every engine (engines resumed first when colocated).
        Returns the bytes sent; `sync_bytes_per_rank` is the most one trainer rank sent.
        `in_place` (disaggregated, full tensors): the engines' running requests are kept, not
        drained; they sample on with the new weights (`EngineWorker.receive_broadcast`)."""
        if in_place and (self.layout.colocated or self.sharded_sync):
            raise ValueError(
                "an in-place weight sync needs disaggregated engines taking full tensors "
                "(no resharding sync)"
            )
        if self.sharded_sync and self.layout.colocated:
            # rank 0's resume returns once every rank of its replica has resumed
            self._on_engines("resume")
            nodes = [
                self._wait(each(f"engine {i} rank", ranks, "node_id"))
                for i, ranks in enumerate(self.replicas)
            ]
            reports = self._wait(
                each(
                    "trainer rank",
                    self.trainers,
                    "push_colocated_shards",
                    self.replicas,
                    nodes,
                    self.bucket_bytes,
                    self.timeout_s,
                )
            )
            self._on_engines("commit")
        elif self.layout.colocated:
            self._on_engines("resume")
            nodes = self._on_engines("node_id")
            reports = self._wait(
                each(
                    "trainer rank",
                    self.trainers,
                    "push_colocated",
                    self.engines,
                    nodes,
                    self.bucket_bytes,
                    self.timeout_s,
                )
            )
            self._on_engines("commit")
        else:  # sources and engines meet in the broadcasts: one wait for all of them
            receivers = (
                [
                    call(f"engine {i} rank {r}", a, "receive_broadcast")
                    for i, ranks in enumerate(self.replicas)
                    for r, a in enumerate(ranks)
                ]
                if self.sharded_sync
                else each("engine", self.engines, "receive_broadcast", in_place)
            )
            reports = self._wait(
                each("trainer rank", self.trainers, "push_broadcast", self.bucket_bytes) + receivers
            )
            reports = reports[: len(self.trainers)]
        if self.staged_memory:
            self._on_trainers("offload")
        self.weight_version += 1
        self.sync_bytes_per_rank = max(r["bytes"] for r in reports)
        return sum(r["bytes"] for r in reports)

    def flush_prefix_caches(self) -> None:
        """Empty every engine's prefix cache (a weight sync does it too), so that every rollout
        starts from an empty cache: what a resumed run's fresh engines have."""
        self._on_engines("flush_prefix_cache")

    # ---------------------------------------------------------------------- engine restarts
    def restart_engine(self, index: int, died: BaseException | None = None):
        """Replace dead engine `index` by a new actor in the same bundle, loaded with the
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
            self._save_hf(scratch)
            (ranks,) = placement.create_engines(
                self.layout,
                self.pg,
                self._engine_config(scratch),
                [placement.engine_name(self.tag, index, self.engine_restarts)],
                self.timeout_s,
                indices=[index],
            )
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.replicas[index] = ranks
        engine = self.engines[index] = ranks[0]
        if getattr(self, "front", None) is not None:
            self.front.replace(index, engine)
        self._wait([call(f"engine {index}", engine, "set_weight_version", self.weight_version)])
        if not self.layout.colocated:
            self._join_sync_group()
        return engine

    # ---------------------------------------------------------------------------- checkpoints
    def _save_hf(self, directory: Path) -> None:
        self._on_trainers("save_hf", str(directory))
        write_model_files(self.model_files, directory)

    def save_engine_weights(self, directory: Path) -> None:
        """Off-policy: the trainer's current weights, which the engines are generating the
        pending rollout with (call it between that rollout's launch and the next train)."""
        self._save_hf(directory / checkpoint.ENGINE_DIR)

    def save_checkpoint(self, directory: Path) -> None:
        """The policy (HF files in `directory`), every rank's training state and, with a KL
        term, the reference. The controller's state is the loop's (`checkpoint.commit`)."""
        self._save_hf(directory)
        self._wait(
            [
                call(
                    f"trainer rank {rank}",
                    t,
                    "save_state",
                    str(checkpoint.rank_file(directory, rank)),
                )
                for rank, t in enumerate(self.trainers)
            ]
        )
        if self.use_reference:
            checkpoint.save_reference(
                self.reference_dir,
                directory / checkpoint.REFERENCE_DIR,
                Path(self.recipe.tracking.output_dir),
            )

    def commit_checkpoint(self, tmp: Path, state: dict) -> Path:
        """Complete the checkpoint written into `tmp` (`checkpoint.commit`). The next one takes
        the reference from it: the one this run started from may be deleted (keep_last)."""
        final = checkpoint.commit(tmp, state, self.recipe.checkpoint.keep_last)
        if self.use_reference:
            self.reference_dir = final / checkpoint.REFERENCE_DIR
        return final

    def layout_state(self) -> dict:
        """What a resumed run must match: the trainer layout and the data's row count."""
        return {
            **_trainer_layout(self.recipe, len(self.trainers)),
            "data_rows": self.source.num_rows,
        }

    def shutdown(self, graceful: bool = True) -> None:
        """Release every actor and the placement group. `graceful` first lets the trainer
        ranks leave their process group; after a failure it is skipped (a surviving rank may be
        blocked in a collective with a dead one)."""
        if graceful:
            try:
                gather(each("trainer rank", self.trainers, "shutdown"), min(self.timeout_s, 60))
            except Exception:  # shutting down after a failure: the actors may be gone already
                pass
        if getattr(self, "rollouts", None) is not None:
            self.rollouts.close()
        if getattr(self, "front", None) is not None:
            self.front.close()
        placement.release(self.pg, self.trainers + [a for ranks in self.replicas for a in ranks])
