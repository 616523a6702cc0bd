"""Sweeps: every job's result.json, and the sweep's summary, checked against the metrics the W&B runs logged."""

import csv
import json
import math
import shutil
import signal
import subprocess
import sys
import time

import optuna

from conftest import REPO, TINY, assert_close, isolated_env, only_run, train


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


def test_optuna_search_over_ddp_jobs_records_every_trial_and_goes_on_past_failed_ones(runs_dir, home):
    """README's search with 4 trials of ddp x 2 jobs. With 200 training samples a batch size of 128 per device
    (global 256) is a config error: those trials must fail in Optuna's records while the search goes on."""
    sweep_dir = runs_dir / "optuna"
    searched = [item for item in TINY if not item.startswith("model.optimizer.lr=")]  # a fixed value is not searched
    result = train(["-m", *searched, "hparams_search=mlp_optuna", "strategy=ddp", "trainer.devices=2", "data.num_train=200",
                    "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep_dir}"], home, expect_ok=False, timeout=600)
    with open(sweep_dir / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    failed = [row for row in rows if row["status"] == "failed"]
    assert len(rows) == 4 and failed and len(failed) < 4  # the seed's 4 trials include both kinds
    assert result.returncode == 1 and f"{len(failed)} of 4 jobs failed" in result.output
    for row in failed:
        assert "data.batch_size=128" in row["overrides"]
        error = json.loads((sweep_dir / row["job"] / "result.json").read_text())["error"]
        assert error.startswith("data.batch_size: gives a global batch of 128 x 2")

    # Optuna's own records, read with Optuna: one trial per job, in job order, its value the job's objective.
    study = optuna.load_study(study_name="train-mlp", storage=f"sqlite:///{sweep_dir}/optuna.db")
    assert len(study.trials) == 4
    for trial, row in zip(study.trials, rows):
        assert set(trial.params) == {"model.optimizer.lr", "data.batch_size"}
        assert all(f"{key}={value}" in row["overrides"].split() for key, value in trial.params.items())
        if row["status"] == "failed":
            assert trial.state == optuna.trial.TrialState.FAIL
        else:
            assert trial.state == optuna.trial.TrialState.COMPLETE
            assert trial.value == assert_result_matches_run(sweep_dir / row["job"])["objective"]
    best_row = next(row for row in rows if row["best"] == "True")
    assert study.best_value == float(best_row["objective"])
    assert study.best_trial.number == int(best_row["job"])


def log_span(job_dir) -> tuple[str, str]:
    """First and last timestamps of a job's train.log ("[2026-11-22 07:39:05,553][...")."""
    lines = [line for line in (job_dir / "train.log").read_text().splitlines() if line.startswith("[20")]
    return lines[0][1:24], lines[-1][1:24]


def test_joblib_runs_two_ddp_jobs_at_once_with_the_numbers_of_one_at_a_time(ddp_fsdp_sweep, runs_dir, home):
    """The ddp_fsdp_sweep again, its two jobs (each 2 worker processes) at the same time: same numbers, one W&B run
    and one result per job."""
    sweep_dir = runs_dir / "joblib"
    result = train(["-m", *TINY, "trainer.devices=2", "data.batch_size=32", "strategy=ddp,fsdp", "hydra/launcher=joblib",
                    "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={sweep_dir}"], home, timeout=600)
    assert "Joblib.Parallel(n_jobs=2" in result.output
    jobs = (sweep_dir / "0", sweep_dir / "1")
    (start0, end0), (start1, end1) = (log_span(job) for job in jobs)
    assert max(start0, start1) < min(end0, end1)  # the two jobs overlapped in time
    for parallel, sequential in zip(jobs, ddp_fsdp_sweep):
        ours, theirs = assert_result_matches_run(parallel), json.loads((sequential / "result.json").read_text())
        assert [ours[key] for key in ("objective", "best_epoch")] == [theirs[key] for key in ("objective", "best_epoch")]
        for key in ("train/loss", "val/loss", "val/acc"):
            assert only_run(parallel).series(key) == only_run(sequential).series(key)


def test_a_preempted_job_requeued_with_ckpt_path_auto_is_one_run_with_every_epoch_once(ddp_fsdp_sweep, runs_dir, home):
    """SIGTERM to a ddp x 2 job after its first epoch (as a cluster preempting it would), then the same command again
    with ckpt_path=auto: one W&B run id, every epoch once, the numbers of the uninterrupted ddp job of the sweep."""
    job_dir = runs_dir / "preempted"
    command = [*TINY, "trainer.devices=2", "data.batch_size=32", "strategy=ddp", "ckpt_path=auto",
               f"hydra.run.dir={job_dir}"]
    job = subprocess.Popen([sys.executable, "train.py", *command, "+callbacks.slow._target_=probes.SlowEpochs",
                            "+callbacks.slow.seconds=3"], cwd=REPO, env=isolated_env(home),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (job_dir / "checkpoints" / "last.ckpt").exists():
        assert time.monotonic() < deadline and job.poll() is None, "no first epoch"
        time.sleep(0.1)
    job.send_signal(signal.SIGTERM)
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 1 and "Traceback" not in output.split("Received SIGTERM")[0], output[-3000:]
    assert "Stopped by SIGTERM: all 2 workers were stopped." in output and "ckpt_path=auto" in output
    first = only_run(job_dir)
    assert 1 <= len(first.series("val/loss")) < 3  # stopped before the end
    shutil.move(first.path, job_dir / "first-attempt")
    train(command, home)  # requeued
    second, straight = only_run(job_dir), only_run(ddp_fsdp_sweep[0])
    assert second.id == first.id
    epochs = [row["epoch"] for row in first.history + second.history if "train/loss" in row]
    assert epochs == [0, 1, 2]
    for key in ("train/loss", "val/loss", "val/acc"):
        assert_close(first.series(key) + second.series(key), straight.series(key), rel=1e-5)
    assert json.loads((job_dir / "result.json").read_text())["epochs"] == 3
