"""Read back what a real W&B run wrote offline, with W&B's own reader: ``wandb leet inspect --json`` prints the
records of the run's ``.wandb`` transaction log, one JSON object per line."""

import json
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

WANDB = str(Path(sys.executable).with_name("wandb"))


@dataclass
class OfflineRun:
    """History rows, config, summary and metric definitions of one offline run."""

    path: Path
    history: list[dict] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)
    metric_definitions: list[dict] = field(default_factory=list)
    name: str = ""
    id: str = ""
    group: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    exit_code: int | None = None

    def series(self, key: str) -> list[float]:
        """Values of ``key`` in logging order (one per epoch for our keys)."""
        return [row[key] for row in self.history if key in row]


@cache
def _read(log_file: Path, size: int, mtime_ns: int) -> OfflineRun:
    """Cached by the file's size and time: the tests read the same finished runs many times."""
    records = subprocess.run(
        [WANDB, "leet", "inspect", "--json", str(log_file)], capture_output=True, text=True, check=True, timeout=60
    ).stdout.splitlines()
    run = OfflineRun(path=log_file.parent)
    for line in records:
        record = json.loads(line)
        kind = record["type"]
        if kind == "run":
            info = record["run"]
            run.name, run.id, run.group = info.get("display_name", ""), info["run_id"], info.get("run_group", "")
            run.job_type, run.tags = info.get("job_type", ""), info.get("tags", [])
            run.config.update(info.get("config", {}).get("update", {}))
        elif kind == "config":
            run.config.update(record["config"].get("update", {}))
        elif kind == "history":
            run.history.append(record["history"]["item"])
        elif kind == "summary":
            run.summary.update(record["summary"].get("update", {}))
        elif kind == "metric":
            run.metric_definitions.append(record["metric"])
        elif kind == "exit":
            run.exit_code = record["exit"].get("exit_code", 0)
    return run


def read_offline_run(run_dir: Path) -> OfflineRun:
    """The run in ``run_dir``, an ``offline-run-*`` folder."""
    (log_file,) = Path(run_dir).glob("run-*.wandb")
    stat = log_file.stat()
    return _read(log_file, stat.st_size, stat.st_mtime_ns)


def offline_runs(job_dir: Path) -> list[OfflineRun]:
    """All offline W&B runs written in a job dir."""
    return [read_offline_run(d) for d in sorted(Path(job_dir).glob("wandb/offline-run-*"))]
