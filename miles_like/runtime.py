"""Everything the RL loop drives, set up from a recipe: Ray placement, the trainer ranks (after
the optional warm start), the engine replicas, the prompt source, the reward function and the
rollout manager; plus the multi-actor calls the loop makes (train, weight sync, memory phases).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import ray

from miles_like import placement
from miles_like.build_configs import critic_config, engine_config, trainer_config
from miles_like.data import PromptSource
from miles_like.model_store import base_model_dir, copy_model_files
from miles_like.rewards import resolve_reward
from miles_like.schema import RecipeError
from miles_like.rollout_manager import RolloutManager
from miles_like.tokenizer import load_tokenizer
from miles_like.warm_start import warm_start
from weight_sync import DEFAULT_BUCKET_BYTES

MIB = 1 << 20


def _bucket_bytes(model_dir: Path) -> int:
    """Sync buckets no larger than the model: a tiny model does not map 2 x 512 MiB."""
    size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
    return int(min(DEFAULT_BUCKET_BYTES, max(MIB, math.ceil(size / MIB) * MIB)))


class Runtime:
    def __init__(self, recipe, log=print):
        self.recipe = recipe
        self.log = log
        self.layout = placement.plan(recipe.cluster)
        base_dir = base_model_dir(recipe.model, recipe.seed)
        try:
            self.tokenizer = load_tokenizer(base_dir)
        except ValueError as e:
            raise RecipeError(str(e)) from None
        hf = json.loads((base_dir / "config.json").read_text())
        context = min(hf.get("max_position_embeddings", 1 << 30),
                      recipe.trainer.max_tokens_per_micro_batch)
        max_prompt = context - recipe.rollout.max_new_tokens
        if max_prompt < 1:
            raise RecipeError(f"rollout.max_new_tokens={recipe.rollout.max_new_tokens} leaves no "
                             f"room for a prompt in the model's context of {context}; lower it")
        # The data is read before any actor starts: a bad file fails in seconds, not minutes.
        self.source = PromptSource(recipe.data, self.tokenizer, seed=recipe.seed,
                                   max_prompt_tokens=max_prompt)
        placement.start_ray(recipe.cluster, self.layout)
        self.pg = placement.reserve(self.layout)
        self.trainers, self.engines = [], []
        try:
            self._start_actors(base_dir, max_prompt)
        except BaseException:
            self.shutdown()
            raise

    def _start_actors(self, base_dir: Path, max_prompt: int) -> None:
        recipe, log = self.recipe, self.log
        self.trainers = placement.create_trainers(self.layout, self.pg)
        self.model_dir = warm_start(recipe, base_dir, self.trainers, self.tokenizer, max_prompt,
                                    log=log)
        alg = recipe.algorithm
        critic = critic_config(recipe, str(self.model_dir)) if alg.advantage == "gae" else None
        ray.get([t.build.remote(trainer_config(recipe, str(self.model_dir)), critic,
                                alg.value_clip) for t in self.trainers])
        device = "cuda" if self.layout.accelerator == "cuda" else "cpu"
        self.engines = placement.create_engines(
            self.layout, self.pg, engine_config(recipe, str(self.model_dir), device))
        self.bucket_bytes = _bucket_bytes(self.model_dir)
        self.num_stages = recipe.trainer.pp
        if not self.layout.colocated:
            port = placement.free_port()
            e = len(self.engines)
            ray.get([eng.join_sync_group.remote(port, i, e, self.num_stages)
                     for i, eng in enumerate(self.engines)]
                    + [t.join_sync_group.remote(port, e, self.num_stages) for t in self.trainers])
        self.rollouts = RolloutManager(recipe, self.engines, self.tokenizer,
                                       resolve_reward(recipe.reward.function), self.source)
        self.staged_memory = self.layout.colocated and self.layout.accelerator == "cuda"

    # ------------------------------------------------------------------------- trainer calls
    def _all(self, method: str, *args):
        """Call `method` on every trainer rank (they hold collectives); rank 0's result."""
        return ray.get([getattr(t, method).remote(*args) for t in self.trainers])[0]

    def values(self, batch_ref):
        return self._all("values", batch_ref)

    def ref_logprobs(self, batch_ref):
        return self._all("ref_logprobs", batch_ref)

    def train(self, batch) -> dict[str, float]:
        """Policy (and critic) updates on one rollout batch; the engines' memory is released
        first when they share the devices."""
        if self.layout.colocated:
            ray.get([e.release.remote() for e in self.engines])
        if self.staged_memory:
            self._all("onload")
        ref = ray.put(batch)
        updates = self.recipe.trainer.updates_per_rollout
        metrics = self._all("train", ref, updates)
        if batch.returns is not None:
            metrics.update({f"critic_{k}": v for k, v in
                            self._all("train_critic", ref, updates).items()})
        return metrics

    def sync_weights(self) -> float:
        """Push the trainer's weights into every engine (engines resumed first when colocated).
        Returns the bytes sent."""
        if self.layout.colocated:
            ray.get([e.resume.remote() for e in self.engines])
            reports = ray.get([t.push_colocated.remote(self.engines, self.bucket_bytes)
                               for t in self.trainers])
            ray.get([e.commit.remote() for e in self.engines])
        else:
            refs = [t.push_broadcast.remote(self.bucket_bytes) for t in self.trainers]
            ray.get([e.receive_broadcast.remote() for e in self.engines])
            reports = ray.get(refs)
        if self.staged_memory:
            self._all("offload")
        return sum(r["bytes"] for r in reports)

    def save_checkpoint(self, directory: Path) -> None:
        ray.get([t.save_hf.remote(str(directory)) for t in self.trainers])
        copy_model_files(self.model_dir, directory)

    def shutdown(self) -> None:
        try:
            ray.get([t.shutdown.remote() for t in self.trainers], timeout=60)
        except Exception:  # shutting down after a failure: the actors may be gone already
            pass
        placement.release(self.pg, self.trainers + self.engines)
