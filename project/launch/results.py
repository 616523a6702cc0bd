"""A job's ``result.json`` and a sweep's summary of them. Standard library only: Hydra's callbacks use it."""

import csv
import json
import logging
import math
from pathlib import Path
from typing import Any

from project.options.writes import written

RESULT_FILE = "result.json"


def job_result(
    epochs: list[dict[str, float]],
    metric: str,
    mode: str,
    status: str,
    runtime_s: float,
    error: str | None = None,
    devices: list[dict[str, Any]] | None = None,
    batch: dict[str, int] | None = None,
) -> dict[str, Any]:
    """What ``result.json`` holds; the objective is None until an epoch has logged ``metric``. ``history`` is every
    epoch's metrics, ``devices`` the latest epoch's per-device memory and throughput, ``batch`` how a training step
    is fed (``data_parallel`` replicas, each ``per_replica`` samples a batch, ``global`` samples an optimizer step)."""
    scored = [epoch for epoch in epochs if not math.isnan(epoch.get(metric, math.nan))]
    best = (max if mode == "max" else min)(scored, key=lambda epoch: epoch[metric]) if scored else None
    return {
        "status": status,
        "objective": None if best is None else best[metric],
        "metric": metric,
        "mode": mode,
        "best_epoch": None if best is None else best["epoch"],
        "best": best,
        "final": epochs[-1] if epochs else None,
        "epochs": len(epochs),
        "runtime_s": round(runtime_s, 3),
        "error": error,
        "history": epochs,
        "devices": devices or [],
        "batch": batch or {},
    }


def write_result(path: Path, result: dict[str, Any]) -> None:
    """Whole or not at all: a reader never sees half a file."""
    with written(path, "result", "Free space on that disk; the job's checkpoints are intact.") as partial:
        partial.write_text(json.dumps(result, indent=2))


def read_result(path: str | Path) -> dict[str, Any] | None:
    """The result in ``path``, None where there is none (a job that failed before training)."""
    path = Path(path)
    return json.loads(path.read_text()) if path.is_file() else None


def _mark(job_dir: Path, status: str, error: str) -> dict[str, Any]:
    """Set the job's result's status and error (a job that ended before training gets a result of its own)."""
    result = read_result(job_dir / RESULT_FILE) or job_result([], "", "max", status, 0.0)
    result.update(status=status, error=" ".join(error.split()))
    write_result(job_dir / RESULT_FILE, result)
    return result


def record_failure(job_dir: Path, error: BaseException) -> None:
    """Mark the job's result as failed with ``error``."""
    result = _mark(job_dir, "failed", str(error))
    logging.getLogger(__name__).error(f"Job failed ({job_dir}): {result['error']}")


def record_stop(job_dir: Path, stop: BaseException) -> None:
    """Mark the job's result as interrupted by ``stop``, a signal: not a failure, and resumable."""
    _mark(job_dir, "interrupted", str(stop))


def mark_interrupted(job_dir: Path) -> None:
    """Mark the job's result as interrupted: its sweep stopped while it ran, and a continued sweep replaced it."""
    _mark(job_dir, "interrupted", "the sweep stopped while this job ran; the continued sweep ran another trial.")


def _job_order(job_dir: Path) -> tuple:
    return (0, int(job_dir.name), "") if job_dir.name.isdigit() else (1, 0, job_dir.name)


def sweep_rows(sweep_dir: str | Path) -> list[dict[str, Any]]:
    """One row per job of the sweep (its subdirs with Hydra's ``.hydra/overrides.yaml``), in job order: the
    overrides that vary between jobs, status, objective, best epoch, final value, runtime, and ``best`` marking the
    completed job with the best objective (a pruned or failed job's objective is of the epochs it ran)."""
    from omegaconf import OmegaConf  # Hydra's own dependency, imported only when a sweep ends

    jobs = sorted((d for d in Path(sweep_dir).iterdir() if (d / ".hydra" / "overrides.yaml").is_file()), key=_job_order)
    overrides: dict[Path, list[str]] = {}
    results: dict[Path, dict[str, Any]] = {}
    broken: dict[Path, str] = {}  # a job whose records cannot be read (a truncated file): the others are summarised
    for job in jobs:
        try:
            overrides[job] = [str(item) for item in OmegaConf.load(job / ".hydra" / "overrides.yaml")]
            results[job] = read_result(job / RESULT_FILE) or {}
        except Exception as error:  # YAML's or JSON's own error, which says where the file breaks
            overrides.setdefault(job, [])
            results[job] = {}
            broken[job] = f"unreadable: {' '.join(str(error).split())[:200]}"
    readable = [items for job, items in overrides.items() if job not in broken]
    shared = set.intersection(*(set(items) for items in readable)) if readable else set()
    rows: list[dict[str, Any]] = []
    for job in jobs:
        result = results[job]
        metric = result.get("metric")
        final = result.get("final") or {}
        rows.append(
            {
                "job": job.name,
                "overrides": " ".join(item for item in overrides[job] if item not in shared),
                "status": broken.get(job) or result.get("status", "no result"),
                "metric": metric,
                "mode": result.get("mode"),
                "objective": result.get("objective"),
                "best_epoch": result.get("best_epoch"),
                "final": final.get(metric) if metric else None,
                "runtime_s": result.get("runtime_s"),
                "best": False,
            }
        )
    scored = [row for row in rows if row["objective"] is not None and row["status"] == "completed"]
    if scored:
        pick = max if scored[0]["mode"] == "max" else min
        pick(scored, key=lambda row: row["objective"])["best"] = True
    return rows


def print_sweep_summary(sweep_dir: str | Path) -> tuple[int, int]:
    """Write the sweep's summary (``write_sweep_summary``) and print it; returns (failed jobs, jobs)."""
    table, failed, jobs = write_sweep_summary(sweep_dir)
    print(f"\nSweep summary ({sweep_dir}/summary.csv, summary.md):\n{table}", flush=True)
    return failed, jobs


def write_sweep_summary(sweep_dir: str | Path) -> tuple[str, int, int]:
    """Write ``summary.csv`` and ``summary.md`` into the sweep dir; returns the markdown table, the number of jobs
    that failed (neither completed, pruned, nor interrupted and replaced by a continued sweep), and the number of
    jobs."""
    sweep_dir = Path(sweep_dir)
    rows = sweep_rows(sweep_dir)
    columns = ["job", "overrides", "status", "objective", "best_epoch", "final", "runtime_s", "best"]
    with open(sweep_dir / "summary.csv", "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=["metric", "mode", *columns], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    metric = next((f"{row['metric']} ({row['mode']})" for row in rows if row["metric"]), "objective")

    def cell(row: dict[str, Any], column: str) -> str:
        value = row[column]
        if column == "best":
            return "best" if value else ""
        if isinstance(value, float):
            return f"{value:.6g}"
        return "" if value is None else str(value).replace("|", "\\|")

    header = [metric if column == "objective" else column for column in columns]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row, column) for column in columns) + " |" for row in rows]
    table = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(table)
    return table, sum(row["status"] not in ("completed", "pruned", "interrupted") for row in rows), len(rows)
