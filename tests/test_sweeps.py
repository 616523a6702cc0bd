"""Sweeps: every job's result.json, and the sweep's summary, checked against the metrics the W&B runs logged."""

import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import submitit
import yaml
from conftest import REPO, TINY, PreloadedRun, assert_close, isolated_env, only_run, require_extra, train
from helpers.wandb_offline import offline_runs
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

from project.config.resolvers import register_resolvers


def assert_result_matches_run(job_dir) -> dict:
    """result.json says what the job's W&B run logged: the best val/acc over epochs, its epoch, the last value."""
    result = json.loads((job_dir / "result.json").read_text())
    logged = only_run(job_dir).series("val/acc")
    best = max(range(len(logged)), key=lambda epoch: logged[epoch])
    assert result["status"] == "completed" and result["metric"] == "val/acc" and result["mode"] == "max"
    assert result["epochs"] == len(logged) == 3 and [row["epoch"] for row in result["history"]] == [0, 1, 2]
    for key in ("train/loss", "val/loss", "val/acc"):  # the per-epoch record the report draws
        assert [row[key] for row in result["history"]] == pytest.approx(only_run(job_dir).series(key), rel=1e-6)
    assert math.isclose(result["objective"], logged[best], rel_tol=1e-12) and result["best_epoch"] == best
    assert math.isclose(result["final"]["val/acc"], logged[-1], rel_tol=1e-12)
    return result


@pytest.mark.slow
def test_a_single_process_job_writes_its_result(single_run):
    assert_result_matches_run(single_run)


@pytest.fixture(scope="module")
def plain_sweep(tmp_path_factory, home) -> tuple[str, Path]:
    """Two single-process jobs of one epoch, the progress bar on (TINY takes it off) as a person at a terminal has
    it, started from a shell that holds a distributed job's RANK and WORLD_SIZE: its output and sweep dir."""
    sweep_dir = tmp_path_factory.mktemp("plain-sweep")
    with_bar = [item for item in TINY if "progress_bar" not in item and item != "trainer.max_epochs=3"]
    args = ["-m", *with_bar, "trainer.max_epochs=1", "logger=none", "seed=1,2", f"hydra.sweep.dir={sweep_dir}"]
    env = {**isolated_env(home), "RANK": "1", "WORLD_SIZE": "2"}
    result = subprocess.run(
        [sys.executable, "train.py", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout + result.stderr, sweep_dir


def test_each_job_of_a_sweep_labels_its_progress_bars(plain_sweep):
    """Jobs that share a terminal (joblib runs them at once) say whose bar is whose. Piped, as here, an epoch's
    finished bar is one line with its metrics (Rich's 80 columns would print them in a column, a line each)."""
    output, _ = plain_sweep
    for number in (0, 1):
        (bar,) = [line for line in output.splitlines() if f"job {number} · Epoch 0/0" in line]
        assert "val/loss:" in bar and "train/acc:" in bar, bar


def test_a_stray_rank_in_the_environment_is_not_taken_for_a_torchrun_worker(plain_sweep):
    """Outside torchrun, RANK=1 is not this process's rank: the sweep's dir is locked and its summary written, as
    rank 0's are (a worker of a torchrun job would do neither)."""
    output, sweep_dir = plain_sweep
    assert (sweep_dir / ".job.lock").is_file() and (sweep_dir / "summary.csv").is_file()
    assert "Sweep summary" in output and "seed=2" in output.split("Sweep summary")[-1]


@pytest.mark.slow
def test_each_job_of_a_multi_process_sweep_writes_its_result_and_the_sweep_a_summary(ddp_fsdp_sweep):
    sweep_dir = ddp_fsdp_sweep[0].parent
    results = [assert_result_matches_run(sweep_dir / str(job)) for job in range(3)]
    with open(sweep_dir / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert [row["job"] for row in rows] == ["0", "1", "2"]
    # what differs between the jobs
    assert [row["overrides"] for row in rows] == ["strategy=ddp", "strategy=fsdp", "strategy=pipeline"]
    assert [float(row["objective"]) for row in rows] == [result["objective"] for result in results]
    best = max(range(3), key=lambda job: results[job]["objective"])
    assert [row["best"] for row in rows] == ["True" if job == best else "False" for job in range(3)]
    table = (sweep_dir / "summary.md").read_text().splitlines()
    assert table[0] == "| job | overrides | status | val/acc (max) | best_epoch | final | runtime_s | best |"
    assert table[2 + best].endswith("| best |") and len(table) == 5


@pytest.mark.slow
def test_optuna_search_over_ddp_jobs_records_every_trial_goes_on_past_failed_ones_and_continues(runs_dir, home):
    """docs/sweeps.md's search with 4 trials of ddp x 2 jobs. With 200 training samples a batch size of 128 per device
    (global 256) is a config error: those trials must fail in Optuna's records while the search goes on. The
    search is killed while a trial trains, then the same command continues it to 4 trials that ended."""
    optuna = require_extra("optuna", "optuna")
    sweep_dir = runs_dir / "optuna"
    searched = [item for item in TINY if not item.startswith("model.optimizer.lr=")]  # a fixed value is not searched
    command = [
        "-m",
        *searched,
        "hparams_search=mlp_optuna",
        "strategy=ddp",
        "trainer.devices=2",
        "data.num_train=200",
        "hydra.sweeper.n_trials=4",
        f"hydra.sweeper.storage=sqlite:///{sweep_dir}/optuna.db",  # an RDB URL, where the default is a journal file
        f"hydra.sweep.dir={sweep_dir}",
    ]
    search = PreloadedRun(command, home)
    deadline = time.monotonic() + 300
    while not (training := [n for n in (1, 2, 3) if (sweep_dir / str(n) / "config.yaml").exists()]):
        assert time.monotonic() < deadline and search.poll() is None, "no trial after the first trained"
        time.sleep(0.1)
    search.kill()  # SIGKILL: as a sweep dies with its login node; the trial's workers die with it
    search.wait()
    interrupted = training[0]
    result = train(command, home, expect_ok=False, timeout=600)
    assert f"Continuing study train-mlp: {interrupted} trials ended, {4 - interrupted} to go." in result.output

    with open(sweep_dir / "summary.csv") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 5 and rows[interrupted]["status"] == "interrupted"  # 4 trials that ended, and the killed one
    failed = [row for row in rows if row["status"] == "failed"]
    assert failed and len(failed) < 4  # the seed's trials include both kinds
    assert result.returncode == 1 and f"{len(failed)} of 5 jobs failed" in result.output
    for row in failed:
        assert "data.batch_size=128" in row["overrides"]
        error = json.loads((sweep_dir / row["job"] / "result.json").read_text())["error"]
        assert error.startswith("data.batch_size: gives a global batch of 128 x 2")

    # Optuna's own records, read with Optuna: one trial per job, in job order, its value the job's objective.
    study = optuna.load_study(study_name="train-mlp", storage=f"sqlite:///{sweep_dir}/optuna.db")
    assert len(study.trials) == 5
    for trial, row in zip(study.trials, rows):
        assert set(trial.params) == {"model.optimizer.lr", "data.batch_size"}
        assert all(f"{key}={value}" in row["overrides"].split() for key, value in trial.params.items())
        if row["status"] in ("failed", "interrupted"):
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


@pytest.mark.slow
def test_joblib_runs_two_ddp_jobs_at_once_with_the_numbers_of_one_at_a_time(ddp_fsdp_sweep, runs_dir, home):
    """The ddp_fsdp_sweep again, its two jobs (each 2 worker processes) at the same time: same numbers, one W&B run
    and one result per job."""
    sweep_dir = runs_dir / "joblib"
    result = train(
        [
            "-m",
            *TINY,
            "trainer.devices=2",
            "data.batch_size=32",
            "strategy=ddp,fsdp",
            "launcher=joblib",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        home,
        timeout=600,
    )
    assert "Joblib.Parallel(n_jobs=2" in result.output
    jobs = (sweep_dir / "0", sweep_dir / "1")
    (start0, end0), (start1, end1) = (log_span(job) for job in jobs)
    assert max(start0, start1) < min(end0, end1)  # the two jobs overlapped in time
    for parallel, sequential in zip(jobs, ddp_fsdp_sweep):
        ours, theirs = assert_result_matches_run(parallel), json.loads((sequential / "result.json").read_text())
        assert [ours[key] for key in ("objective", "best_epoch")] == [
            theirs[key] for key in ("objective", "best_epoch")
        ]
        for key in ("train/loss", "val/loss", "val/acc"):
            assert only_run(parallel).series(key) == only_run(sequential).series(key)


def preempt(command: list[str], home, signum: int, after_epochs: int, job_dir) -> str:
    """Start ``train.py <command>`` (epochs slowed down), send it ``signum`` once ``after_epochs`` epochs are in its
    result.json, and return its output: the job must stop cleanly, saying how to resume."""
    job = PreloadedRun(
        [*command, "+callbacks.slow._target_=helpers.probes.SlowEpochs", "+callbacks.slow.seconds=3"], home
    )
    deadline, result = time.monotonic() + 120, job_dir / "result.json"
    while not (result.exists() and json.loads(result.read_text())["epochs"] >= after_epochs):
        assert time.monotonic() < deadline and job.poll() is None, "the job did not get that far"
        time.sleep(0.1)
    job.send_signal(signum)
    output, _ = job.communicate(timeout=120)
    name = signal.Signals(signum).name
    # Every rank stops after the same batch (StopTogether): none is left in a collective its peer quit.
    assert job.returncode == 128 + signum and "Traceback" not in output, output[-3000:]
    assert f"Stopped by {name}: all 2 workers were stopped." in output
    assert f"hydra.run.dir={job_dir} ckpt_path=auto" in output  # the command that resumes it
    return output


@pytest.mark.slow
def test_a_preempted_job_requeued_with_ckpt_path_auto_is_one_run_with_every_epoch_once(ddp_fsdp_sweep, runs_dir, home):
    """A ddp x 2 job stopped by SLURM's early warning (SIGUSR1) after its first epoch, requeued, stopped by SIGTERM
    (a preemption) after its second, requeued again with the same command (ckpt_path=auto): one W&B run id, every
    epoch once, the numbers of the uninterrupted ddp job of the sweep."""
    job_dir = runs_dir / "preempted"
    command = [
        *TINY,
        "trainer.devices=2",
        "data.batch_size=32",
        "strategy=ddp",
        "ckpt_path=auto",
        f"hydra.run.dir={job_dir}",
    ]
    output = preempt(command, home, signal.SIGUSR1, after_epochs=1, job_dir=job_dir)
    assert output.count("Received SIGTERM") == 2  # each worker stopped as for SIGTERM: cleanly, by Lightning
    preempt(command, home, signal.SIGTERM, after_epochs=2, job_dir=job_dir)
    train(command, home)  # requeued
    attempts = sorted(offline_runs(job_dir), key=lambda run: run.path.name)
    assert len(attempts) == 3 and len({attempt.id for attempt in attempts}) == 1
    epochs = [[row["epoch"] for row in attempt.history if "train/loss" in row] for attempt in attempts]
    assert epochs == [[0], [1], [2]]
    straight = only_run(ddp_fsdp_sweep[0])
    for key in ("train/loss", "val/loss", "val/acc"):
        assert_close([value for attempt in attempts for value in attempt.series(key)], straight.series(key), rel=1e-5)
    assert json.loads((job_dir / "result.json").read_text())["epochs"] == 3


@pytest.mark.parametrize("accelerator, gpu_flag", [("auto", "#SBATCH --gpus-per-node=4"), ("cpu", None)])
def test_the_slurm_launcher_sizes_each_job_from_the_trainer_config(accelerator, gpu_flag, tmp_path, monkeypatch):
    """launcher=slurm as a user composes it, through hydra-submitit-launcher's own launch() up to the sbatch script
    submitit writes (nothing is submitted: the executor is captured before it calls sbatch)."""
    register_resolvers()
    with initialize_config_dir(str(REPO / "conf"), version_base="1.3"):
        cfg = compose(
            "train",
            return_hydra_config=True,
            overrides=[
                "launcher=slurm",
                "strategy=ddp",
                "trainer.devices=4",
                "trainer.num_nodes=2",
                f"trainer.accelerator={accelerator}",
                "hydra.launcher.partition=gpu",
                f"hydra.sweep.dir={tmp_path}",
            ],
        )
    assert cfg.ckpt_path == "auto"  # a requeued job resumes
    executors = []
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", lambda executor, *args: executors.append(executor) or [])
    fake_srun = tmp_path / "bin" / "srun"  # submitit's test for a SLURM cluster: srun on the PATH
    fake_srun.parent.mkdir()
    fake_srun.write_text("#!/bin/sh\nexit 1\n")
    fake_srun.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_srun.parent}:{os.environ['PATH']}")
    launcher = instantiate(cfg.hydra.launcher)
    assert type(launcher).__name__ == "SlurmLauncher"  # hydra-submitit-launcher's
    launcher.setup(hydra_context=None, task_function=None, config=cfg)
    launcher.launch([["strategy=ddp"]], initial_job_idx=0)
    script = executors[0]._executor._make_submission_file_text("python -m submitit.core._submit x", "uid")
    flags = {line for line in script.splitlines() if line.startswith("#SBATCH")}
    assert {
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=240",
        "#SBATCH --signal=USR2@120",
    } <= flags
    gpu_flags = {flag for flag in flags if "gpu" in flag and "partition" not in flag}
    assert gpu_flags == ({gpu_flag} if gpu_flag else set())


@pytest.mark.slow
def test_slurm_local_runs_two_ddp_jobs_and_a_preempted_one_is_requeued_into_the_same_run(
    ddp_fsdp_sweep, runs_dir, home
):
    """The ddp_fsdp_sweep again through launcher=slurm_local (hydra-submitit-launcher, submitit's local executor:
    both jobs at once). Job 0 gets submitit's preemption signal (SIGUSR2) after its first epoch: submitit requeues
    it, and the requeued job resumes from last.ckpt (ckpt_path=auto) into the same W&B run. Each job ends with
    one result and the numbers of the jobs run one at a time."""
    sweep_dir = runs_dir / "slurm-local"
    sweep = PreloadedRun(
        [
            "launcher=slurm_local",
            *TINY,
            "trainer.devices=2",
            "data.batch_size=32",
            "strategy=ddp,fsdp",
            f"hydra.sweep.dir={sweep_dir}",
            "+callbacks.slow._target_=helpers.probes.SlowEpochs",
            "+callbacks.slow.seconds=1.5",
        ],
        home,
    )
    deadline = time.monotonic() + 120
    while not (sweep_dir / "0" / "checkpoints" / "last.ckpt").exists():
        assert time.monotonic() < deadline and sweep.poll() is None, "no first epoch"
        time.sleep(0.1)
    task = json.loads((sweep_dir / "0" / ".job.lock").read_text())["pid"]  # the node task running job 0
    os.kill(task, signal.SIGUSR2)
    output, _ = sweep.communicate(timeout=300)
    assert sweep.returncode == 0, output[-6000:]
    submitit_log = "".join(path.read_text() for path in (sweep_dir / ".submitit").glob("*_0_log.err"))
    assert "Caught signal SIGUSR2" in submitit_log and "this job is preempted" in submitit_log

    with open(sweep_dir / "summary.csv") as file:
        assert [row["status"] for row in csv.DictReader(file)] == ["completed", "completed"]
    attempts = sorted(offline_runs(sweep_dir / "0"), key=lambda run: run.path.name)
    assert len(attempts) == 2 and attempts[0].id == attempts[1].id  # one W&B run, logged by two attempts
    assert [row["epoch"] for attempt in attempts for row in attempt.history if "train/loss" in row] == [0, 1, 2]
    straight = only_run(ddp_fsdp_sweep[0])
    for key in ("train/loss", "val/loss", "val/acc"):
        assert_close(attempts[0].series(key) + attempts[1].series(key), straight.series(key), rel=1e-5)
    assert json.loads((sweep_dir / "0" / "result.json").read_text())["objective"] == max(straight.series("val/acc"))
    assert_result_matches_run(sweep_dir / "1")
    for key in ("train/loss", "val/loss", "val/acc"):
        assert only_run(sweep_dir / "1").series(key) == only_run(ddp_fsdp_sweep[1]).series(key)


@pytest.mark.slow
def test_slurm_local_runs_a_two_node_job_with_a_task_per_node(ddp_fsdp_sweep, runs_dir, home):
    """trainer.num_nodes=2 x 1 device: two node tasks, each starting its rank; they meet as a cluster's nodes do
    (static rendezvous at node 0). Same world size and global batch as the ddp x 2 job, so the same numbers."""
    sweep_dir = runs_dir / "slurm-two-nodes"
    train(
        [
            "launcher=slurm_local",
            *TINY,
            "strategy=ddp",
            "trainer.devices=1",
            "trainer.num_nodes=2",
            "data.batch_size=32",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        home,
    )
    job = sweep_dir / "0"
    assert len(list((sweep_dir / ".submitit").glob("*_1_log.out"))) == 1  # a second task
    assert (job / "workers" / "node1" / "config.yaml").is_file()  # ...which started node 1's rank
    assert "[rank 1]" in (job / "train.log").read_text()
    # Global rank 0 ran on node 0: its W&B run is the one the job's config.yaml names, which a requeue continues.
    assert only_run(job).id == yaml.safe_load((job / "config.yaml").read_text())["logger"]["wandb"]["id"]
    assert_result_matches_run(job)
    for key in ("train/loss", "val/loss", "val/acc"):
        assert_close(only_run(job).series(key), only_run(ddp_fsdp_sweep[0]).series(key), rel=1e-5)


@pytest.mark.slow
def test_a_cluster_sweep_over_node_counts_fails_each_job_before_it_starts(runs_dir, home):
    """The launcher sizes every job from the command line's values (here the default, 1 node), so jobs asking for
    2 or 3 nodes must fail at once, each with a config error saying how to sweep node counts."""
    sweep_dir = runs_dir / "slurm-node-sweep"
    result = train(
        [
            "launcher=slurm_local",
            *TINY,
            "strategy=ddp",
            "trainer.devices=1",
            "trainer.num_nodes=2,3",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        home,
        expect_ok=False,
    )
    assert result.returncode == 1 and "2 of 2 jobs failed" in result.output
    for job, nodes in ((0, 2), (1, 3)):
        error = json.loads((sweep_dir / str(job) / "result.json").read_text())["error"]
        assert error.startswith(f"trainer.num_nodes: is {nodes}, but the cluster launcher started this job on 1 nodes")
        assert "Fix: run each value of trainer.num_nodes (and of trainer.devices) as a sweep of its own." in error
        assert not (sweep_dir / str(job) / "workers").exists()  # no worker started
