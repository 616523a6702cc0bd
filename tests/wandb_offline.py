"""Read back what a real W&B run wrote offline: the records in ``run-<id>.wandb``.

wandb writes its transaction log in LevelDB's log format (32 KiB blocks of chunks, each with a 7-byte header:
CRC32, length, type), after a 7-byte file header; every whole record is a ``wandb_internal_pb2.Record``.
The Python reader for it left the wandb package when its core moved to Go, so the tests carry this small one.
"""

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path

from wandb.proto import wandb_internal_pb2

BLOCK_SIZE = 32 * 1024
FILE_HEADER_SIZE = 7  # ":W&B", a 2-byte magic and a version byte
CHUNK_HEADER_SIZE = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path: Path) -> list[wandb_internal_pb2.Record]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    records, pending, offset = [], b"", FILE_HEADER_SIZE
    while offset + CHUNK_HEADER_SIZE <= len(data):
        block_left = BLOCK_SIZE - offset % BLOCK_SIZE
        if block_left < CHUNK_HEADER_SIZE:  # trailer padding of a block
            offset += block_left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[offset : offset + CHUNK_HEADER_SIZE])
        chunk = data[offset + CHUNK_HEADER_SIZE : offset + CHUNK_HEADER_SIZE + length]
        offset += CHUNK_HEADER_SIZE + length
        if kind == 0 and length == 0:
            break  # zero padding at the end
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


@dataclass
class OfflineRun:
    """History rows, config, summary and metric definitions of one offline run."""

    path: Path
    history: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    metric_definitions: list = field(default_factory=list)
    name: str = ""
    id: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    exit_code: int | None = None

    def series(self, key: str) -> list[float]:
        """Values of ``key`` in logging order (one per epoch for our keys)."""
        return [row[key] for row in self.history if key in row]


def _item_key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def read_offline_run(run_dir: Path) -> OfflineRun:
    """Parse ``<run_dir>/run-*.wandb``; ``run_dir`` is an ``offline-run-*`` folder."""
    (log_file,) = Path(run_dir).glob("run-*.wandb")
    run = OfflineRun(path=Path(run_dir))
    for record in _records(log_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.name, run.group, run.tags = record.run.display_name, record.run.run_group, list(record.run.tags)
            run.id, run.job_type = record.run.run_id, record.run.job_type
            for item in record.run.config.update:
                run.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[_item_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            run.history.append({_item_key(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "summary":
            for item in record.summary.update:
                run.summary[_item_key(item)] = json.loads(item.value_json)
        elif kind == "metric":
            run.metric_definitions.append(record.metric)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def offline_runs(job_dir: Path) -> list[OfflineRun]:
    """All offline W&B runs written in a job dir."""
    return [read_offline_run(d) for d in sorted(Path(job_dir).glob("wandb/offline-run-*"))]
