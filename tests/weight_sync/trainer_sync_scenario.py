"""Trainer -> engine weight sync after real training steps, both transports, in real processes.

Roles (run by tests/weight_sync/test_trainer_to_engine.py):
* `engine OUT MODEL NUM_SOURCES PORT_FILE`: one process holding a rollout Engine; it listens for
  the sources on a port the OS picks and writes it to PORT_FILE.
* `trainer OUT MODEL TP PP LISTEN_PORT`: the trainer world, under torchrun (LISTEN_PORT: the
  engine's).

Round 1, colocated: two PPO steps; each source rank (TP rank 0 of each pipeline stage) streams
`export_hf_weights()` through a ColocatedSender (shared memory, handles over a local socket) into
the engine; the other TP ranks drain the same export (its all-gathers need them).
Round 2, broadcast: one more step; sources and the engine form a standalone SyncGroup (gloo) and
the sources broadcast their stage's buckets.
After each round the engine saves its parameters, samples from a few prompts at T = 1 and sends
the samples back; every trainer rank recomputes their log-probs and rank 0 saves them with the
trainer's gathered HF state dict. The test compares the files.
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Client, Listener

import torch

AUTH = b"miles_like-weight-sync-test"
PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7, 9]]


class _ConnFuture:
    def __init__(self, conn):
        self.conn = conn

    def result(self):
        return self.conn.recv()


def engine_role(out: str, model_dir: str, num_sources: int, port_file: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from rollout import Engine, EngineConfig, SamplingParams
    from weight_sync import BroadcastReceiver, BucketReceiver, SyncGroup

    torch.set_num_threads(1)
    engine = Engine(EngineConfig(model_path=model_dir, kv_cache_tokens=512))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True, seed=7)
    results = {}
    # a port bound here, not one probed free by the test and bound later (another process
    # could take it in between); written whole (renamed into place) for the test to read
    with Listener(("127.0.0.1", 0), authkey=AUTH) as listener:
        with open(f"{port_file}.tmp", "w") as f:
            f.write(str(listener.address[1]))
        os.replace(f"{port_file}.tmp", port_file)
        conns = {}
        for _ in range(num_sources):
            conn = listener.accept()
            conns[conn.recv()] = conn  # each source first says which stage it is
        stages = sorted(conns)

        def sample_and_report(round_name):
            results[round_name] = {
                n: p.detach().clone() for n, p in engine.model.named_parameters()
            }
            outs = engine.generate(PROMPTS, params)
            samples = [
                (prompt + s.token_ids, len(prompt), s.logprobs)
                for prompt, per in zip(PROMPTS, outs)
                for s in per
            ]
            conns[stages[0]].send(samples)

        # Round 1: colocated, stage by stage.
        receiver = BucketReceiver(engine)
        for stage in stages:
            while (msg := conns[stage].recv()) != "done":
                conns[stage].send(receiver.load(*msg))
        receiver.commit()
        sample_and_report("colocated")
        # Round 2: broadcast over a standalone group; the engine is its rank 0 and hosts its
        # store on a port it binds itself (a port probed free and bound later can be taken in
        # between, e.g. by gloo's own connections), sent to every source.
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=300)
        )
        for conn in conns.values():
            conn.send(store.port)
        group = SyncGroup.create(
            "127.0.0.1", store.port, rank=0, size=num_sources + 1, master_store=store
        )
        BroadcastReceiver(engine, group, sources=list(range(1, num_sources + 1))).receive()
        sample_and_report("broadcast")
        results["weight_version"] = engine.weight_version
        torch.save(results, out)
        for conn in conns.values():
            conn.recv()  # wait for the trainer's goodbye before closing
            conn.close()


def trainer_role(out: str, model_dir: str, tp: int, pp: int, listen_port: int) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from trainer import RLBatch, make_trainer
    from weight_sync import BroadcastSender, ColocatedSender, SyncGroup

    from scenarios import fixed_batch, trainer_config

    trainer = make_trainer(trainer_config(model_dir, tp, pp))
    batch = fixed_batch(trainer.vocab_size)
    is_source = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    stage = ps.get_pipeline_model_parallel_rank()
    conn = Client(("127.0.0.1", listen_port), authkey=AUTH) if is_source else None
    if conn is not None:
        conn.send(stage)
    results = {}

    def check(round_name):
        """Receive the engine's samples (stage 0's source), share them, recompute log-probs."""
        box = [conn.recv() if (is_source and stage == 0) else None]
        dist.broadcast_object_list(box, src=0)
        samples = box[0]
        rl = RLBatch(tokens=[t for t, _, _ in samples], prompt_lens=[p for _, p, _ in samples])
        trainer_lp = trainer.compute_logprobs(rl)
        state = trainer.hf_state_dict()
        results[round_name] = dict(
            state=state,
            engine_logprobs=[torch.tensor(lp) for _, _, lp in samples],
            trainer_logprobs=[lp.cpu() for lp in trainer_lp],
        )

    for _ in range(2):
        trainer.train_step(batch)
    if is_source:

        def deliver(handle, manifest):
            conn.send((handle, manifest))
            return _ConnFuture(conn)

        sender = ColocatedSender(deliver, bucket_bytes=16 << 10)
        results["colocated_report"] = sender.send(trainer.export_hf_weights())._asdict()
        conn.send("done")
    else:
        for _ in trainer.export_hf_weights():  # take part in the TP all-gathers
            pass
    check("colocated")

    trainer.train_step(batch)
    if is_source:
        group = SyncGroup.create("127.0.0.1", conn.recv(), rank=1 + stage, size=1 + pp)
        sources = list(range(1, 1 + pp))
        results["broadcast_report"] = (
            BroadcastSender(group, sources, bucket_bytes=16 << 10)
            .send(trainer.export_hf_weights())
            ._asdict()
        )
    else:
        for _ in trainer.export_hf_weights():
            pass
    check("broadcast")
    if is_source:
        conn.send("bye")
        conn.close()
    if dist.get_rank() == 0:
        torch.save(results, out)
    from trainer.parallel import destroy_parallel

    destroy_parallel()


if __name__ == "__main__":
    role, out, model_dir, *rest = sys.argv[1:]
    if role == "engine":
        engine_role(out, model_dir, int(rest[0]), rest[1])
    else:
        trainer_role(out, model_dir, *map(int, rest))
