"""Both transports across Ray actors: an engine actor receives from a trainer-side actor.

Colocated: the sender passes shared-memory handles + manifests through actor calls (Ray pickles
only those) and waits on the returned ObjectRefs as acknowledgements. Broadcast: the two actors
join a standalone SyncGroup, whose port the engine actor (its rank 0) holds from the moment the OS
picks it. The reference is the new checkpoint itself (bitwise) and a fresh engine loaded from it
(greedy outputs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import ray
import shared_ray
import torch

from rollout import Engine, EngineConfig, SamplingParams

from tiny_hf import make_hf_model, save_hf_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [7, 7, 1]]


@ray.remote
class EngineActor:
    def __init__(self, model_dir: str):
        from weight_sync import BucketReceiver

        torch.set_num_threads(1)
        self.engine = Engine(EngineConfig(model_path=model_dir, kv_cache_tokens=256))
        self.receiver = BucketReceiver(self.engine)

    def load(self, handle, manifest):
        return self.receiver.load(handle, manifest)

    def commit(self):
        self.receiver.commit()

    def rendezvous(self) -> tuple[str, int]:
        """Where the broadcast group meets: this actor is its rank 0 and holds the port from the
        moment the OS picks it (as `EngineWorker.rendezvous`)."""
        from miles_like.run.rendezvous import held_rendezvous

        return held_rendezvous()

    def receive_broadcast(self, host: str, port: int):
        from miles_like.run.rendezvous import take_held_store
        from weight_sync import BroadcastReceiver, SyncGroup

        store = take_held_store(port, timeout_s=300.0)
        group = SyncGroup.create(host, port, rank=0, size=2, master_store=store)
        return BroadcastReceiver(self.engine, group, sources=[1]).receive().num_buckets

    def snapshot(self):
        return (
            {n: p.detach().numpy().copy() for n, p in self.engine.model.named_parameters()},
            [[s.token_ids for s in per] for per in self.engine.generate(PROMPTS, GREEDY)],
            self.engine.weight_version,
        )


class _RefFuture:
    def __init__(self, ref):
        self.ref = ref

    def result(self):
        return ray.get(self.ref)


@ray.remote
class SenderActor:
    """Stands where a trainer source rank stands: holds weights, streams them out."""

    def __init__(self, model_dir: str):
        from rollout.weights import iter_safetensors

        torch.set_num_threads(1)
        self.weights = dict(iter_safetensors(model_dir))

    def send_colocated(self, engine) -> int:
        from weight_sync import ColocatedSender

        sender = ColocatedSender(
            lambda h, m: _RefFuture(engine.load.remote(h, m)), bucket_bytes=16 << 10
        )
        report = sender.send(self.weights.items())
        ray.get(engine.commit.remote())
        sender.close()
        return report.num_buckets

    def send_broadcast(self, host: str, port: int) -> int:
        from weight_sync import BroadcastSender, SyncGroup

        group = SyncGroup.create(host, port, rank=1, size=2)
        return (
            BroadcastSender(group, sources=[1], bucket_bytes=16 << 10)
            .send(self.weights.items())
            .num_buckets
        )


@pytest.fixture(scope="module")
def ray_local():
    here = Path(__file__).resolve().parent
    # Workers import this module by name to build the actors, so they get the test paths; the
    # node stays on loopback.
    path = os.pathsep.join([str(here.parent.parent), str(here.parent), str(here)])
    shared_ray.stop()  # the controller modules' local Ray, if one is left running
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )
    yield
    ray.shutdown()


@pytest.mark.slow
def test_both_transports_between_ray_actors(ray_local, tmp_path):
    old = save_hf_model(make_hf_model("qwen3", seed=0), tmp_path / "old")
    new1 = save_hf_model(make_hf_model("qwen3", seed=1), tmp_path / "new1")
    new2 = save_hf_model(make_hf_model("qwen3", seed=2), tmp_path / "new2")
    engine = EngineActor.options(num_cpus=0).remote(str(old))
    from rollout.weights import iter_safetensors

    for model_dir, transport in ((new1, "colocated"), (new2, "broadcast")):
        sender = SenderActor.options(num_cpus=0).remote(str(model_dir))
        if transport == "colocated":
            buckets = ray.get(sender.send_colocated.remote(engine))
        else:
            host, port = ray.get(engine.rendezvous.remote())
            received, buckets = ray.get(
                [
                    engine.receive_broadcast.remote(host, port),
                    sender.send_broadcast.remote(host, port),
                ]
            )
            assert received == buckets
        assert buckets > 1
        params, outputs, version = ray.get(engine.snapshot.remote())
        assert version == (1 if transport == "colocated" else 2)
        for name, tensor in iter_safetensors(model_dir):
            assert torch.equal(torch.tensor(params[name]), tensor), f"{transport}: {name}"
        fresh = Engine(EngineConfig(model_path=str(model_dir), kv_cache_tokens=256)).generate(
            PROMPTS, GREEDY
        )
        assert outputs == [[s.token_ids for s in per] for per in fresh]
