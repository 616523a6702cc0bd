"""Sweeps: every job's result.json, and the sweep's summary, checked against the metrics the W&B runs logged."""

import csv
import json
import math

from conftest import only_run


def assert_result_matches_run(job_dir) -> dict:
    """result.json says what the job's W&B run logged: the best val/acc over epochs, its epoch, the last value."""
    result = json.loads((job_dir / "result.json").read_text())
    logged = only_run(job_dir).series("val/acc")
    best = max(range(len(logged)), key=lambda epoch: logged[epoch])
    assert result["status"] == "completed" and result["metric"] == "val/acc" and result["mode"] == "max"
    assert result["epochs"] == len(logged) == 3
    assert math.isclose(result["objective"], logged[best], rel_tol=1e-12) and result["best_epoch"] == best
    assert math.isclose(result["final"]["val/acc"], logged[-1], rel_tol=1e-12)
    return result


def test_a_single_process_job_writes_its_result(single_run):
    assert_result_matches_run(single_run)


def test_each_job_of_a_multi_process_sweep_writes_its_result_and_the_sweep_a_summary(ddp_fsdp_sweep):
    results = [assert_result_matches_run(job) for job in ddp_fsdp_sweep]
    sweep_dir = ddp_fsdp_sweep[0].parent
    with open(sweep_dir / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert [row["job"] for row in rows] == ["0", "1"]
    assert [row["overrides"] for row in rows] == ["strategy=ddp", "strategy=fsdp"]  # what differs between the jobs
    assert [float(row["objective"]) for row in rows] == [result["objective"] for result in results]
    best = max(range(2), key=lambda job: results[job]["objective"])
    assert [row["best"] for row in rows] == ["True" if job == best else "False" for job in range(2)]
    table = (sweep_dir / "summary.md").read_text().splitlines()
    assert table[0] == "| job | overrides | status | val/acc (max) | best_epoch | final | runtime_s | best |"
    assert table[2 + best].endswith("| best |") and len(table) == 4
