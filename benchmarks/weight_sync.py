"""Weight-sync benchmark: a >= 100M-parameter random model pushed into an engine in another process.

Measures, in one run:
* `copy`: a plain in-process torch copy of the same bytes into preallocated tensors (the floor);
* `colocated`: ColocatedSender -> shared memory -> BucketReceiver -> the engine's parameters,
  with the RL loop's hand-off (`weight_sync.BucketStream`: a socket per sync, not a call per
  bucket);
* `broadcast`: BroadcastSender -> gloo broadcast -> BroadcastReceiver -> the engine's parameters;
each with checksums on (the default) and, for colocated, off, to report verification's cost.
Prints one JSON object. Goal: colocated <= 2x the copy time on CPU, checksums on.

    python benchmarks/weight_sync.py [--hidden 1024 --layers 8 --vocab 32000] [--bucket-mb 512]
                                     [--colocated-bucket-mb 16 --buffers 2 --no-split-tensors]
                                     [--syncs 3] [--skip-broadcast]

The colocated runs use the RL loop's setting: buckets the size of the cache
(`weight_sync.STREAM_BUCKET_BYTES`) with tensors split across them (a receiver verifies a bucket,
then copies it out of cache).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.run_record import RunRecord, add_output_args  # noqa: E402
from rollout import Engine, EngineConfig  # noqa: E402
from rollout.random_checkpoint import TINY_QWEN2, write_random_checkpoint  # noqa: E402
from rollout.weights import iter_safetensors  # noqa: E402
from weight_sync import (  # noqa: E402
    STREAM_BUCKET_BYTES,
    STREAM_NUM_BUFFERS,
    BroadcastReceiver,
    BroadcastSender,
    BucketReceiver,
    BucketStream,
    ColocatedSender,
    SyncGroup,
    receive_stream,
)
from weight_sync.checksum import algorithm_for, checksum  # noqa: E402


def _config(args) -> dict:
    return {
        **TINY_QWEN2,
        "hidden_size": args.hidden,
        "intermediate_size": args.hidden * 11 // 4,
        "num_hidden_layers": args.layers,
        "num_attention_heads": args.hidden // 64,
        "num_key_value_heads": max(1, args.hidden // 256),
        "vocab_size": args.vocab,
    }


def _trainer_weights(model_dir: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """What a trainer would export: same names and shapes, different values."""
    return {n: t.to(device) + 0.001 for n, t in iter_safetensors(model_dir)}


def _engine(model_dir: str, device: str = "cpu") -> Engine:
    return Engine(
        EngineConfig(model_path=model_dir, kv_cache_tokens=64, max_model_len=64, device=device)
    )


def _digests(named_tensors) -> dict[str, int]:
    """Byte checksums (xxh3 on CPU, wsum64 on GPU): equal digests = the same bytes, for the bitwise
    check."""
    return {name: checksum(t) for name, t in named_tensors}


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _colocated_engine(model_dir: str, conn, verify: bool, device: str) -> None:
    """The engine's process: each sync is one command on the pipe (as the RL loop's one actor
    call per sync) that runs `receive_stream` until the sender's end message."""
    engine = _engine(model_dir, device)
    receiver = BucketReceiver(engine, verify=verify)
    conn.send("ready")
    while (msg := conn.recv()) != "exit":
        if msg == "commit":
            receiver.commit()
            conn.send(engine.weight_version)
        elif msg == "digest":
            conn.send(_digests(engine.model.named_parameters()))
        else:
            conn.send(receive_stream(msg, receiver, timeout_s=600.0))


def _alive(proc) -> None:
    if not proc.is_alive():
        raise EOFError(f"the engine process exited (code {proc.exitcode})")


def run_colocated(
    model_dir: str,
    weights: dict,
    bucket_bytes: int,
    verify: bool,
    syncs: int = 3,
    device: str = "cpu",
    num_buffers: int = 2,
    split_tensors: bool = False,
) -> dict:
    """Several syncs in a row, as in training, through the RL loop's colocated transport
    (`BucketStream`: one start command per sync, the buckets' hand-offs on its socket); the
    first also pays for mapping fresh shared memory. Returns the first and the best later
    report, and whether the engine's weights then equal the trainer's bitwise."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_colocated_engine, args=(model_dir, child, verify, device))
    proc.start()
    child.close()  # the engine's end: were it kept open here, recv() would hang if it dies
    assert parent.recv() == "ready"
    stream = BucketStream()
    sender = ColocatedSender(
        stream.deliver,
        bucket_bytes=bucket_bytes,
        verify=verify,
        device=device,
        num_buffers=num_buffers,
        split_tensors=split_tensors,
    )
    reports = []
    for version in range(1, syncs + 1):
        start = time.perf_counter()
        parent.send(stream.address)
        stream.accept(1, timeout_s=600.0, check=lambda: _alive(proc))
        report = sender.send(weights.items())
        stream.finish()
        assert parent.recv().num_buckets == report.num_buckets
        parent.send("commit")
        assert parent.recv() == version
        reports.append(report._replace(total_s=time.perf_counter() - start))
    parent.send("digest")
    bitwise = parent.recv() == _digests(weights.items())
    parent.send("exit")
    proc.join()
    sender.close()
    stream.close()
    steady = min(reports[1:], key=lambda r: r.total_s)
    return {**steady._asdict(), "first_sync_total_s": reports[0].total_s, "bitwise_equal": bitwise}


def _broadcast_rank(rank: int, port: int, model_dir: str, bucket_bytes: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 0:
        weights = _trainer_weights(model_dir)
        dist.barrier()
        report = BroadcastSender(SyncGroup.default(), [0], bucket_bytes=bucket_bytes).send(
            weights.items()
        )
        queue.put(("sender", report._asdict()))
    else:
        engine = _engine(model_dir)
        dist.barrier()
        report = BroadcastReceiver(engine, SyncGroup.default(), [0]).receive()
        queue.put(("receiver", report._asdict()))
    dist.destroy_process_group()


def run_broadcast(model_dir: str, bucket_bytes: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        ctx.Process(target=_broadcast_rank, args=(r, port, model_dir, bucket_bytes, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    return {
        "sender": results["sender"],
        "receiver": results["receiver"],
        "total_s": max(results["sender"]["total_s"], results["receiver"]["total_s"]),
    }


def main(argv=None) -> dict:
    record = RunRecord.start("weight_sync", argv)
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--device", default="cpu", help="cpu, or cuda: CUDA IPC buckets between the processes"
    )
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--bucket-mb", type=int, default=512, help="broadcast buckets")
    parser.add_argument(
        "--colocated-bucket-mb",
        type=int,
        default=STREAM_BUCKET_BYTES >> 20,
        help="colocated buckets: small enough to be verified and copied out while cached",
    )
    parser.add_argument(
        "--buffers",
        type=int,
        default=STREAM_NUM_BUFFERS,
        help="colocated buckets in flight (the RL loop's: weight_sync.STREAM_NUM_BUFFERS)",
    )
    parser.add_argument(
        "--split-tensors",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="cut tensors larger than a colocated bucket into pieces "
        "(ColocatedSender(split_tensors=True)); --no-split-tensors: a bucket of their own",
    )
    parser.add_argument(
        "--syncs",
        type=int,
        default=3,
        help="colocated syncs per setting (the first is not counted)",
    )
    parser.add_argument(
        "--skip-broadcast",
        action="store_true",
        help="skip the gloo broadcast (CPU only: NCCL needs a GPU per rank)",
    )
    add_output_args(parser)
    args = parser.parse_args(argv)
    device = args.device
    skip_broadcast = args.skip_broadcast or torch.device(device).type == "cuda"
    bucket_bytes = args.bucket_mb << 20
    loadavg = [os.getloadavg()]  # the box is shared: a figure means little without its load
    with tempfile.TemporaryDirectory() as model_dir:
        write_random_checkpoint(model_dir, _config(args))
        weights = _trainer_weights(model_dir, device)
        nbytes = sum(t.nbytes for t in weights.values())
        params = sum(t.numel() for t in weights.values())
        targets = {n: torch.empty_like(t) for n, t in weights.items()}

        def best_copy_s(repeats: int = 3) -> float:
            best = float("inf")
            for _ in range(repeats):
                _sync(device)
                start = time.perf_counter()
                for n, t in weights.items():
                    targets[n].copy_(t)
                _sync(device)
                best = min(best, time.perf_counter() - start)
            return best

        # The baseline is measured before and after the colocated runs and the best kept: the
        # box is shared, and the fastest copy is the hardest reference.
        copy_s = [best_copy_s()]
        colocated_bytes = args.colocated_bucket_mb << 20
        layout = {"num_buffers": args.buffers, "split_tensors": args.split_tensors}
        colocated = run_colocated(
            model_dir, weights, colocated_bytes, True, args.syncs, device, **layout
        )
        colocated_noverify = run_colocated(
            model_dir, weights, colocated_bytes, False, args.syncs, device, **layout
        )
        copy_s.append(best_copy_s())
        best_copy = min(copy_s)
        broadcast = None if skip_broadcast else run_broadcast(model_dir, bucket_bytes)
    gb = nbytes / 1e9
    result = {
        "device": device,
        "params": params,
        "bytes": nbytes,
        "bucket_bytes": colocated_bytes,  # the colocated runs'
        "broadcast_bucket_bytes": bucket_bytes,
        "num_buffers": args.buffers,
        "split_tensors": args.split_tensors,
        "torch_num_threads": torch.get_num_threads(),
        "copy_s": best_copy,
        "copy_GBps": gb / best_copy,
        "colocated": {
            **colocated,
            "GBps": gb / colocated["total_s"],
            "x_copy": colocated["total_s"] / best_copy,
        },
        "colocated_no_checksum": {
            **colocated_noverify,
            "GBps": gb / colocated_noverify["total_s"],
            "x_copy": colocated_noverify["total_s"] / best_copy,
        },
        "copy_s_before_after": copy_s,
        "checksum_algorithm": algorithm_for(torch.empty(1, device=device)),
        "loadavg_1_5_15_start_end": loadavg + [os.getloadavg()],
        "broadcast": broadcast
        and {
            **broadcast,
            "GBps": gb / broadcast["total_s"],
            "x_copy": broadcast["total_s"] / best_copy,
        },
    }
    record.finish(result, args)
    return result


if __name__ == "__main__":
    print(json.dumps(main(), indent=2))
