"""Colocated weight-push routing by (node, GPU), on CPU with Ray's fake GPUs.

A CUDA IPC handle opens only in a process that sees the sender's GPU, and Ray shows each actor
only its own GPU. So in a colocated layout the push must pair each engine with the trainer rank
on its GPU, not hand every engine of a node the buffers of one source rank (which a real GPU run
would fail on at the first sync, and no CPU run sees: host shared memory has no such limit).

Ray is started with 4 GPUs that do not exist (`num_gpus=4`): it still assigns them to actors
(`ray.get_gpu_ids()`, `CUDA_VISIBLE_DEVICES`). The real trainer and engine actors are placed in
the real placement group with the colocated layout's options; inside each, the GPU UUID
(`weight_sync.identity.device_uuid`, which needs a real GPU) is replaced by the id of the GPU
Ray gave it. Their own `device_identity()` then says where they are, and the controller's
routing (`weight_push.colocated_routes` / `sharded_routes`) runs on those identities for each
trainer layout, with the trainer coordinates written out from megatron's rank order (TP
innermost, then DP, then PP) as an independent reference.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import ray
import shared_ray

from miles_like.models.store import base_model_dir
from miles_like.recipe import load_recipe
from miles_like.recipe.build_configs import engine_config
from miles_like.run import placement
from miles_like.run.engine_worker import EngineWorker
from miles_like.run.trainer_worker import TrainerWorker
from miles_like.run.weight_push import SenderPlace, colocated_routes, sharded_routes
from weight_sync import DeviceIdentity

RECIPE = str(Path(__file__).resolve().parents[2] / "recipes" / "tiny_arith_grpo.yaml")
GPUS = 4
pytestmark = pytest.mark.slow


def fake_uuid_inside(worker) -> tuple[list, str]:
    """Runs inside an actor: its GPU's UUID becomes the GPU id Ray assigned it."""
    import os

    import ray

    import weight_sync.identity

    ids = [str(i) for i in ray.get_gpu_ids()]
    weight_sync.identity.device_uuid = lambda device: "GPU-fake-" + ",".join(ids)
    return ids, os.environ.get("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="module")
def identities():
    """(trainer identity, engine identity) of each bundle of a colocated 4-GPU layout."""
    shared_ray.stop()
    ray.init(
        num_cpus=GPUS,
        num_gpus=GPUS,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
        runtime_env={"env_vars": {"PYTHONPATH": shared_ray.PATH}},
    )
    try:
        recipe = load_recipe(RECIPE, ["cluster.devices=4", "cluster.accelerator=cpu"])
        layout = placement.plan(recipe.cluster)._replace(accelerator="cuda")
        assert layout.colocated and layout.trainer_bundles == layout.engine_bundles
        pg = placement.reserve(layout, timeout_s=120)
        cfg = engine_config(recipe, str(base_model_dir(recipe.model, recipe.seed)), "cpu")
        # on CPU: the actors compute on the CPU; Ray still gives each half of its bundle's GPU
        trainers = [
            TrainerWorker.options(**placement.actor_options(layout, pg, b)).remote(
                rank, GPUS, 1, "cpu"
            )
            for rank, b in enumerate(layout.trainer_bundles)
        ]
        engines = [
            EngineWorker.options(**placement.actor_options(layout, pg, b)).remote(cfg, 1)
            for b in layout.engine_bundles
        ]
        actors = trainers + engines
        visible = ray.get([a.__ray_call__.remote(fake_uuid_inside) for a in actors], timeout=600)
        ids = ray.get([a.device_identity.remote() for a in actors], timeout=120)
        yield (
            [DeviceIdentity(*i) for i in ids[:GPUS]],
            [DeviceIdentity(*i) for i in ids[GPUS:]],
            visible,
        )
        placement.release(pg, actors)
    finally:
        ray.shutdown()


def megatron_places(trainer_ids, tp: int, pp: int) -> dict[int, SenderPlace]:
    """Rank -> place in megatron's default order: TP rank innermost, then DP, PP outermost."""
    dp = len(trainer_ids) // (tp * pp)
    return {
        rank: SenderPlace(trainer_ids[rank], rank // (tp * dp), rank % tp)
        for rank in range(len(trainer_ids))
    }


def test_trainer_rank_i_and_engine_i_share_gpu_i(identities):
    trainers, engines, visible = identities
    gpus = [ids for ids, _ in visible]
    assert all(len(g) == 1 for g in gpus), gpus
    assert gpus[:GPUS] == gpus[GPUS:]  # bundle i: trainer rank i and engine i
    assert len({g[0] for g in gpus[:GPUS]}) == GPUS  # four different GPUs
    assert [cvd for _, cvd in visible[:GPUS]] == [cvd for _, cvd in visible[GPUS:]]
    assert trainers == engines
    assert len(set(trainers)) == GPUS


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["dp4", "tp2xdp2", "pp2xdp2"])
def test_each_engine_is_fed_by_the_rank_on_its_gpu(identities, tp, pp):
    """Full tensors (engine TP 1): engine i takes each stage through shared buffers from the
    rank of that stage on its GPU; a stage with no rank on its GPU (pipeline parallelism) sends
    it bytes, from the stage's first rank. No shared route joins two different GPUs."""
    trainers, engines, _ = identities
    places = megatron_places(trainers, tp, pp)
    routes = colocated_routes(places, dict(enumerate(engines)))
    assert set(routes) == set(range(GPUS))
    for rank, r in routes.items():
        for e in r.shared:
            assert engines[e] == trainers[rank]
    stages = sorted({p.stage for p in places.values()})
    for e in range(GPUS):
        for s in stages:
            fed = [(rank, "shared") for rank, r in routes.items() if e in r.shared]
            fed += [(rank, "bytes") for rank, r in routes.items() if e in r.as_bytes]
            fed = [(rank, how) for rank, how in fed if places[rank].stage == s]
            if places[e].stage == s:  # rank e is on engine e's GPU
                assert fed == [(e, "shared")]
            else:
                first = min(r for r, p in places.items() if p.stage == s)
                assert fed == [(first, "bytes")]
    if pp == 1:  # every rank feeds exactly its own engine
        assert {rank: r.shared for rank, r in routes.items()} == {i: (i,) for i in range(GPUS)}


def test_resharding_sync_pairs_tp_rank_r_with_engine_rank_r_on_its_gpu(identities):
    """Trainer TP 2 = engine TP 2, two replicas: replica i rank r sits in bundle 2 i + r, with
    trainer rank 2 i + r (DP rank i, TP rank r), which feeds it its own shards."""
    trainers, engines, _ = identities
    places = megatron_places(trainers, 2, 1)
    replicas = [engines[0:2], engines[2:4]]
    routes = sharded_routes(places, replicas)
    for rank in range(GPUS):
        i, r = divmod(rank, 2)
        assert routes[rank].shared == (i,) and routes[rank].as_bytes == ()
        assert replicas[i][places[rank].tp_rank] == trainers[rank]
