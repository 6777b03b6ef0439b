"""Read the metrics an offline wandb run logged, straight from its `run-*.wandb` file.

wandb 0.31 ships no Python reader for it (its writer is the Go `wandb-core`). The file is a
7-byte header (`:W&B`, a 2-byte magic, a version byte) followed by LevelDB log records: 32 KiB
blocks; each record has a 4-byte CRC, a 2-byte little-endian length and a type (1 full, 2 first,
3 middle, 4 last); a block's tail shorter than a record header is padding. Each full record is
a `wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768
HEADER = 7


def raw_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    if data[:4] != b":W&B":
        raise ValueError(f"{path} is not a wandb run file")
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def history(path: Path) -> list[dict[str, object]]:
    """One dict per `wandb.log` call: metric key -> JSON-decoded value."""
    import json

    from wandb.proto import wandb_internal_pb2

    rows = []
    for raw in raw_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append(
                {
                    (item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                    for item in record.history.item
                }
            )
    return rows
