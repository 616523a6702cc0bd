"""Faults: what happens to checkpoints, workers and job dirs when something goes wrong."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, PreloadedRun, train
from helpers.probes import thaw
from hydra.utils import instantiate
from lightning.pytorch.plugins import MixedPrecision
from test_config import compose_train
from test_loop_accounting import fit

from project.config.build import build_net
from project.launch.stop_together import StopTogether

pytestmark = pytest.mark.slow


def saved_epoch(path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False)["epoch"]


def first_epoch_stays_best(job_dir) -> list[str]:
    """A TINY run in ``job_dir`` whose checkpoint callback monitors the step count with mode=min: every epoch after
    the first is worse than the best, which stays epoch000.ckpt."""
    return [
        *TINY,
        f"hydra.run.dir={job_dir}",
        "logger=csv",
        "callbacks.model_checkpoint.monitor=step",
        "callbacks.model_checkpoint.mode=min",
    ]


def test_last_is_the_latest_epoch_when_the_metric_gets_worse(home, tmp_path):
    """Monitoring the step count with mode=min makes every epoch after the first worse than the best."""
    job_dir = tmp_path / "job"
    train(first_epoch_stays_best(job_dir), home)
    checkpoints = job_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["epoch000.ckpt", "last.ckpt"]
    assert saved_epoch(checkpoints / "epoch000.ckpt") == 0  # the best stays the first epoch...
    assert saved_epoch(checkpoints / "last.ckpt") == 2  # ...and last is the third of 3
    log = (job_dir / "train.log").read_text()  # the job's log: Lightning's records, through Hydra's log file
    assert "[lightning.fabric.utilities.seed][INFO] - Seed set to 42" in log and "`max_epochs=3` reached" in log


def test_a_damaged_last_checkpoint_resumes_from_the_newest_intact_one(home, tmp_path):
    """A truncated last.ckpt (epoch 1) is passed over for epoch000.ckpt, the best and only intact one, and the run
    goes on from there; with that one emptied too, ckpt_path=last is refused before launch."""
    job_dir = tmp_path / "job"
    run = first_epoch_stays_best(job_dir)
    train([*run, "trainer.max_epochs=2"], home)
    checkpoints = job_dir / "checkpoints"
    last = checkpoints / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    result = train([*run, "trainer.max_epochs=3", "ckpt_path=last"], home)
    assert f"{last} is not a checkpoint file" in result.output
    assert f"resuming from {checkpoints / 'epoch000.ckpt'}, the newest intact checkpoint" in result.output
    assert saved_epoch(last) == 2  # epochs 1 and 2 trained again from epoch 0's end
    last.write_bytes(b"")
    (checkpoints / "epoch000.ckpt").write_bytes(b"")
    refused = train([*run, "trainer.max_epochs=4", "ckpt_path=last"], home, expect_ok=False)
    assert refused.returncode == 1
    assert "holds no intact checkpoint" in refused.output and "Traceback" not in refused.output


def test_a_kill_during_the_first_last_checkpoint_resumes_from_the_best_one_and_keeps_it(home, tmp_path):
    """SIGKILL while the first last.ckpt is written (after epoch000.ckpt): ckpt_path=auto, as a requeued job runs,
    resumes from epoch000.ckpt and leaves it as it was; a fresh start into that dir is refused, nothing written."""
    job_dir = tmp_path / "job"
    run = [*first_epoch_stays_best(job_dir), "trainer.max_epochs=2"]
    killed = train([*run, "+callbacks.kill._target_=helpers.probes.KillWhileWritingLast"], home, expect_ok=False)
    assert killed.returncode == -signal.SIGKILL, killed.output[-3000:]
    checkpoints = job_dir / "checkpoints"
    assert sorted(path.name for path in checkpoints.iterdir()) == ["epoch000.ckpt", "last.ckpt.partial"]
    best = (checkpoints / "epoch000.ckpt").read_bytes()
    refused = train(run, home, expect_ok=False)  # ckpt_path=null: from scratch, over the checkpoints
    assert refused.returncode == 1 and "Traceback" not in refused.output, refused.output[-3000:]
    assert f"ckpt_path: is null (start from scratch), but {checkpoints} holds checkpoints" in refused.output
    assert "Fix: resume them with ckpt_path=auto" in refused.output
    resumed = train([*run, "ckpt_path=auto"], home)
    assert f"{checkpoints / 'last.ckpt'} does not exist: resuming from {checkpoints / 'epoch000.ckpt'}" in (
        resumed.output
    )
    assert f"Restored all states from the checkpoint at {checkpoints / 'epoch000.ckpt'}" in resumed.output
    assert (checkpoints / "epoch000.ckpt").read_bytes() == best  # never written over
    assert saved_epoch(checkpoints / "last.ckpt") == 1  # only epoch 1 trained


def test_a_resume_with_other_settings_keeps_the_first_attempts_records_and_says_what_changed(home, tmp_path):
    """Resumed with another batch size, a job says which setting changed and that its numbers will differ; the
    first attempt's overrides and config stay in .hydra/attempts/0/ (they used to be overwritten)."""
    job_dir = tmp_path / "job"
    run = [*TINY, f"hydra.run.dir={job_dir}", "logger=csv"]
    train([*run, "trainer.max_epochs=1"], home)
    first_config = (job_dir / "config.yaml").read_text()
    resumed = train([*run, "trainer.max_epochs=2", "data.batch_size=32", "ckpt_path=auto"], home)
    assert f"Resuming {job_dir} with data.batch_size=32 (was 64): training goes on" in resumed.output
    kept = job_dir / ".hydra" / "attempts" / "0"
    assert "trainer.max_epochs=1" in (kept / "overrides.yaml").read_text()
    assert "data.batch_size=32" not in (kept / "overrides.yaml").read_text()
    assert (kept / "job_config.yaml").read_text() == first_config
    assert "data.batch_size=32" in (job_dir / ".hydra" / "overrides.yaml").read_text()


def test_a_one_device_checkpoint_resumed_under_fsdp_x_2_goes_on_as_the_uninterrupted_run(home, tmp_path):
    """Epoch 0 on one device, epoch 1 under fsdp x 2 from its last.ckpt (the same global batch of 64): epoch 1's
    numbers are those of one device training both epochs, SGD's momentum buffers included (it used to fail with
    'The size of tensor a (64) must match the size of tensor b (32)': the optimizer state keyed in the wrong order)."""
    run = [*TINY, "logger=csv", "trainer.max_epochs=2"]
    straight = train([*run, f"hydra.run.dir={tmp_path / 'straight'}"], home)
    assert straight.returncode == 0
    train([*TINY, "logger=csv", "trainer.max_epochs=1", f"hydra.run.dir={tmp_path / 'first'}"], home)
    resumed = [
        *run,
        "strategy=fsdp",
        "trainer.devices=2",
        "data.batch_size=32",
        f"hydra.run.dir={tmp_path / 'resumed'}",
        f"ckpt_path={tmp_path / 'first' / 'checkpoints' / 'last.ckpt'}",
    ]
    train(resumed, home)
    expected, got = (
        json.loads((tmp_path / name / "result.json").read_text())["history"] for name in ("straight", "resumed")
    )
    for key in ("train/loss", "val/loss", "val/acc"):
        assert [row[key] for row in got] == pytest.approx([row[key] for row in expected], rel=1e-5), key


@pytest.mark.parametrize(
    "override, message",
    [
        ("optimized_metric.name=val/accuracy", "optimized_metric.name: is 'val/accuracy', which this run does not log"),
        (
            "optimized_metric.also=[val/loss,val/accuracy]",
            "optimized_metric.also: names 'val/accuracy', which this run does not log",
        ),
    ],
)
def test_an_optimized_metric_the_run_never_logs_fails_it_after_its_first_validated_epoch(
    override, message, home, tmp_path
):
    """optimized_metric.name=val/accuracy (the MLP logs val/acc), or such a name among the metrics a multi-objective
    search is returned (.also): the job used to train every epoch and end "completed" without an objective, each
    trial of a search recorded FAIL while the search exited 0."""
    job_dir = tmp_path / "job"
    result = train([*TINY, override, f"hydra.run.dir={job_dir}"], home, expect_ok=False)
    assert result.returncode == 1 and "Traceback" not in result.output, result.output[-3000:]
    assert f"{message}. Fix: name one it logs:" in result.output
    assert "val/acc, val/loss" in result.output
    recorded = json.loads((job_dir / "result.json").read_text())
    assert recorded["status"] == "failed" and recorded["epochs"] == 0


def test_an_unwritable_checkpoints_dir_stops_the_run(home, tmp_path):
    """The dir turns unwritable when epoch 1 starts; saving epoch 1 must fail the run, naming the path and cause."""
    job_dir = tmp_path / "job"
    checkpoints = job_dir / "checkpoints"
    try:
        result = train(
            [
                *TINY,
                f"hydra.run.dir={job_dir}",
                "logger=csv",
                "callbacks.model_checkpoint.save_top_k=-1",
                "+callbacks.freeze._target_=helpers.probes.FreezeCheckpointsDir",
                "+callbacks.freeze.epoch=1",
            ],
            home,
            expect_ok=False,
        )
    finally:
        if checkpoints.exists():
            thaw(checkpoints)
    assert result.returncode != 0
    assert f"Could not write checkpoint {checkpoints}/epoch001.ckpt: Operation not permitted" in result.output or (
        f"Could not write checkpoint {checkpoints}/epoch001.ckpt: Permission denied" in result.output
    ), result.output[-3000:]
    # What was saved before is whole: epoch 0, as best and as last.
    assert sorted(path.name for path in checkpoints.iterdir()) == ["epoch000.ckpt", "last.ckpt"]
    assert saved_epoch(checkpoints / "last.ckpt") == 0


@pytest.mark.parametrize("layout", [[], ["strategy=fsdp", "trainer.devices=2"]], ids=["auto", "fsdp_x2"])
def test_a_full_disk_stops_the_run_with_the_path_and_no_partial_file(home, small_disk, layout):
    """The job dir on a 24 MiB file system: two checkpoints of 8.6 MiB fit, the third does not. The run ends with
    the documented message naming the file, exit code 1, no traceback on the console; the partial checkpoint is
    gone, the earlier ones are whole and result.json says failed, with the message."""
    job_dir = small_disk("24m") / "job"
    result = train(
        [
            *TINY,
            "model.net.hidden_dims=[1024,1024]",
            f"hydra.run.dir={job_dir}",
            "logger=csv",
            "callbacks.model_checkpoint.save_top_k=-1",
            *layout,
        ],
        home,
        expect_ok=False,
    )
    checkpoints = job_dir / "checkpoints"
    message = re.search(r"Could not write checkpoint (\S+): No space left on device \(ENOSPC\)\. (.*)", result.output)
    assert result.returncode == 1 and message, result.output[-3000:]
    assert "Traceback" not in result.output
    assert message.group(2).startswith("Training stopped so that no later epoch goes unsaved")
    assert "Free space on that disk (or make the checkpoints dir writable), then resume with ckpt_path=auto" in (
        message.group(2)
    )
    assert not list(job_dir.rglob("*.partial")), sorted(job_dir.rglob("*"))
    saved = sorted(path.name for path in checkpoints.iterdir())
    assert saved == ["epoch000.ckpt", "last.ckpt"], saved
    assert all(saved_epoch(path) == 0 for path in checkpoints.iterdir() if path.is_file())  # whole (fsdp: dirs)
    recorded = json.loads((job_dir / "result.json").read_text())
    assert recorded["status"] == "failed" and recorded["error"].startswith("WriteFailed: Could not write checkpoint")
    if layout:  # fsdp: written in the background, the failure logged as it happened, the previous one kept
        assert "could not be written in the background" in (job_dir / "train.log").read_text()


def test_sigterm_stops_a_sweep_with_its_summary_and_the_command_that_resumes_it(home, tmp_path):
    """SIGTERM to a plain -m sweep of one-device jobs during job 0 (it used to exit 0, the next job dropped without a
    word): exit code 143, job 0 recorded interrupted in the summary, job 1 not started, and the printed command
    resumes job 0 from its checkpoint and runs job 1."""
    sweep_dir = tmp_path / "sweep"
    command = ["-m", *TINY, "logger=csv", f"hydra.sweep.dir={sweep_dir}", "model.optimizer.lr=0.1,0.05"]
    sweep = PreloadedRun(
        [*command, "+callbacks.slow._target_=helpers.probes.SlowEpochs", "+callbacks.slow.seconds=2"], home
    )
    deadline = time.monotonic() + 120
    while not (sweep_dir / "0" / "checkpoints" / "last.ckpt").exists():
        assert time.monotonic() < deadline and sweep.poll() is None, "job 0 saved no checkpoint"
        time.sleep(0.1)
    sweep.send_signal(signal.SIGTERM)
    output, _ = sweep.communicate(timeout=120)
    assert sweep.returncode == 128 + signal.SIGTERM and "Traceback" not in output, output[-3000:]
    assert re.search(r"Stopped by SIGTERM in epoch \d, after \d+ optimizer steps\.", output)
    assert "| 0 |  | interrupted |" in (sweep_dir / "summary.md").read_text() and not (sweep_dir / "1").exists()
    resume = re.search(r"Resume the sweep with:\n  ((?:\S*/)?python train\.py .*)", output)  # .venv/bin/python
    assert resume and resume.group(1).endswith(f"hydra.sweep.dir={sweep_dir} ckpt_path=auto"), output[-3000:]
    program, *args = shlex.split(resume.group(1))[1:]
    assert program == "train.py"
    resumed = train(args, home)
    assert (
        f"Restored all states from the checkpoint at {sweep_dir / '0' / 'checkpoints' / 'last.ckpt'}" in resumed.output
    )
    rows = (sweep_dir / "summary.md").read_text()
    assert "| completed |" in rows and rows.count("completed") == 2, rows


# Runs that go on until the test stops them: a ddp job of 2 workers.
ENDLESS_DDP = [*TINY, "logger=csv", "strategy=ddp", "trainer.devices=2", "trainer.max_epochs=100000"]


def start_train(args: list[str], home) -> PreloadedRun:
    """``python train.py <args>`` whose workers are its own children, started from scratch, as a user's are."""
    return PreloadedRun(args, home, fresh_workers=True)


def wait_for(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.2)


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a live process, None once it is gone (a zombie is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (fields[0], int(fields[1]))


def children(pid: int) -> list[int]:
    return [
        int(stat.parent.name)
        for stat in Path("/proc").glob("[0-9]*/stat")
        if (state := process_state(int(stat.parent.name))) is not None and state[1] == pid
    ]


def worker_rank(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(item for item in environ if item.startswith(b"RANK="))[5:])


@contextmanager
def endless_job(args: list[str], home):
    """A running ``python train.py``, killed with whatever it started when the test ends."""
    launcher = start_train(args, home)
    try:
        yield launcher
    finally:
        for pid in [launcher.pid, *children(launcher.pid)]:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.communicate()


def signal_rank_1(sig: signal.Signals, home, tmp_path, *overrides: str) -> tuple[int, str, list[int], float]:
    """Send ``sig`` to rank 1 of an endless ddp job once it has trained an epoch; wait (at most 2 minutes) for the
    job to end. Returns its exit code, its output, the workers' pids and the seconds from the signal to the end."""
    job_dir = tmp_path / "job"
    with endless_job([*ENDLESS_DDP, f"hydra.run.dir={job_dir}", *overrides], home) as launcher:
        wait_for(lambda: (job_dir / "checkpoints" / "last.ckpt").exists(), 120, "a first epoch")
        workers = {worker_rank(pid): pid for pid in children(launcher.pid)}
        os.kill(workers[1], sig)
        signalled = time.monotonic()
        output, _ = launcher.communicate(timeout=120)
    return launcher.returncode, output, list(workers.values()), time.monotonic() - signalled


def test_ctrl_c_on_a_multi_process_run_says_a_line_a_rank_at_most_then_how_to_resume(home, tmp_path):
    """Ctrl-C: SIGINT to the launcher and its workers at once, as a terminal sends it to its foreground group. The
    job exits 130, and after the signal says at most a line a rank, then the launcher's report: the signal, and the
    command that resumes the run. No traceback, no torchelastic line ("Received 2 death signal, ...")."""
    job_dir = tmp_path / "job"
    with endless_job([*ENDLESS_DDP, f"hydra.run.dir={job_dir}"], home) as launcher:
        wait_for(lambda: (job_dir / "checkpoints" / "last.ckpt").exists(), 120, "a first epoch")
        before = len(launcher.output_file.read_text())
        for pid in [launcher.pid, *children(launcher.pid)]:
            os.kill(pid, signal.SIGINT)
        output, _ = launcher.communicate(timeout=120)
    said = [line for line in output[before:].splitlines() if line.strip()]
    assert launcher.returncode == 128 + signal.SIGINT and "Traceback" not in output, output[-3000:]
    report = next(index for index, line in enumerate(said) if "Stopped by SIGINT: all 2 workers were stopped." in line)
    assert report <= 2 and "death signal" not in output, said
    assert len(said) == report + 2 and said[-1].endswith(f"hydra.run.dir={job_dir} ckpt_path=auto"), said


def test_a_workers_second_ctrl_c_is_ignored_even_after_lightning_puts_its_handler_back():
    """The race behind a traceback once seen in CI: a worker's first SIGINT raises KeyboardInterrupt; Lightning's
    teardown then restores the handler it saved at setup (the worker's own), and torchelastic's copy of the signal
    lands after it. That copy must not raise again. Run in a process of its own: the handler is process-wide."""
    script = """
import signal
from project.launch.processes import interrupt_once
interrupt_once()
saved = signal.getsignal(signal.SIGINT)  # what Lightning's signal connector keeps at setup
try:
    signal.raise_signal(signal.SIGINT)  # the terminal's Ctrl-C
except KeyboardInterrupt:
    print("interrupted")
signal.signal(signal.SIGINT, saved)  # its teardown puts it back
signal.raise_signal(signal.SIGINT)  # torchelastic's copy, passed on late
print("went on")
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.split()) == (0, ["interrupted", "went", "on"]), done.stderr


def test_a_stopped_worker_fails_the_job_within_the_heartbeat_timeout_with_every_stack_in_the_log(home, tmp_path):
    """SIGSTOP on rank 1, a hung rank: with strategy.heartbeat_timeout=15 (the default 60 s would add 45 s of
    waiting to the suite; collectives keep their 5 minutes) the launcher's watchdog fails the job once 15 s pass,
    names rank 1 on the console, and leaves every rank's Python stack in train.log, rank 1's included (it is
    continued to write it, then killed)."""
    exit_code, output, workers, seconds = signal_rank_1(signal.SIGSTOP, home, tmp_path, "strategy.heartbeat_timeout=15")
    # Not before the timeout; how long after it depends on the machine's load (the watchdog's polls, the kills), so
    # the upper bound is signal_rank_1's 2 minutes, not a figure of a quiet machine
    assert exit_code == 1 and seconds > 15, (exit_code, seconds, output[-3000:])
    noticed = re.search(r"Rank 1 \(pid \d+\) has sent no heartbeat for (\d+) s \(strategy.heartbeat_timeout=15", output)
    assert noticed and 15 <= int(noticed[1]) <= seconds + 1, output[-3000:]
    assert re.search(r"Training failed in the workers:\n- rank 1 sent no heartbeat for \d+ s", output), output[-3000:]
    log = (tmp_path / "job" / "train.log").read_text()
    for rank in (0, 1):
        stacks = log.split(f"--- Python stacks of rank {rank} ")[1].split("\n--- ")[0]
        assert "(most recent call first):" in stacks and 'File "' in stacks, stacks
    assert all(process_state(pid) is None for pid in workers)


def assert_all_gone(pids: list[int], within: float) -> None:
    wait_for(lambda: all(process_state(pid) is None for pid in pids), within, f"workers {pids} end")


def test_killing_the_launcher_mid_training_ends_its_workers_and_frees_the_job_dir(home, tmp_path):
    job_dir = tmp_path / "job"
    args = [*ENDLESS_DDP, f"hydra.run.dir={job_dir}"]
    with endless_job(args, home) as launcher:
        last = job_dir / "checkpoints" / "last.ckpt"
        wait_for(last.exists, 120, "a first epoch")
        workers = children(launcher.pid)
        assert len(workers) == 2
        # While the job runs, a second job sent into its dir is refused before it starts anything, or writes
        # anything there: the job's .hydra record (what a resume reads its overrides from) and log stay its own.
        record = {path: path.read_bytes() for path in [*(job_dir / ".hydra").iterdir(), job_dir / "train.log"]}
        second = train([*args, "seed=7"], home, expect_ok=False)
        assert second.returncode == 1 and "Traceback" not in second.stderr
        assert (
            f"Config error: hydra.run.dir: {job_dir} is in use by a running job (pid {launcher.pid} on "
            in second.stderr
        )
        assert len(record) == 4 and all(path.read_bytes().startswith(old) for path, old in record.items())
        assert "seed=7" not in (job_dir / ".hydra" / "overrides.yaml").read_text()
        launcher.kill()  # SIGKILL: the launcher's own handlers never run
        assert_all_gone(workers, within=10)
    # The killed job's lock is taken over: resuming into its dir works.
    resumed_epochs = saved_epoch(last) + 2
    train([*args, "ckpt_path=last", f"trainer.max_epochs={resumed_epochs}"], home)
    assert saved_epoch(last) == resumed_epochs - 1


def test_killing_the_launcher_during_start_up_ends_its_workers(home, tmp_path):
    with endless_job([*ENDLESS_DDP, f"hydra.run.dir={tmp_path / 'job'}"], home) as launcher:
        wait_for(lambda: len(children(launcher.pid)) == 2, 120, "2 workers started")
        workers = children(launcher.pid)
        launcher.kill()
        assert_all_gone(workers, within=10)


def test_jobs_started_in_the_same_second_get_dirs_of_their_own(home, tmp_path):
    """Pairs of runs with the default run dir, started together, until a pair starts within one second."""
    runs = tmp_path / "logs" / "train" / "runs"
    for attempt in range(5):
        pair = [
            PreloadedRun([*TINY, "logger=csv", "trainer.max_epochs=1", f"paths.log_dir={tmp_path / 'logs'}"], home)
            for _ in range(2)
        ]
        for job in pair:
            output, _ = job.communicate(timeout=300)
            assert job.returncode == 0, output[-3000:]
        dirs = sorted(runs.iterdir())
        assert len(dirs) == 2 * (attempt + 1), [d.name for d in dirs]  # one dir per job
        latest = dirs[-2:]
        if latest[0].name[:19] == latest[1].name[:19]:  # the same second: %Y-%m-%d_%H-%M-%S
            break
    else:
        pytest.skip("no pair of jobs started within the same second")
    for job_dir in latest:
        assert (job_dir / "config.yaml").is_file() and (job_dir / ".hydra" / "overrides.yaml").is_file()
        assert sorted(path.name for path in (job_dir / "checkpoints").iterdir()) == ["epoch000.ckpt", "last.ckpt"]


def poisoned(poison: str, options: list[str]) -> list[str]:
    """A ddp x 2 TINY run whose rank 1 gets ``poison`` (``helpers.probes``) before global step 21."""
    return [
        *TINY,
        "logger=csv",
        "strategy=ddp",
        "trainer.devices=2",
        "data.batch_size=32",
        *options,
        f"+callbacks.poison._target_=helpers.probes.{poison}",
        "+callbacks.poison.step=20",
        "+callbacks.poison.rank=1",
    ]


@pytest.mark.parametrize(
    "poison, options, cause",
    [
        ("PoisonWeights", [], "the training loss was not finite (rank 1's was nan)"),
        ("PoisonGradients", ["trainer.gradient_clip_val=1.0"], "the gradient norm was not finite (on rank 1)"),
    ],
)
def test_a_diverging_ddp_job_stops_every_rank_after_the_same_step_and_its_sweep_records_why(
    poison, options, cause, home, tmp_path
):
    """Before global step 21 (16 steps an epoch: epoch 1, batch 4), rank 1 gets NaN weights (its loss of that batch
    is NaN, rank 0's finite), or an infinite gradient with clipping on (every loss of that batch finite; clipped by
    an infinite norm, its parameters turn NaN). Both ranks stop after that step and name it; the job fails, naming
    epoch 0's last.ckpt, which stays epoch 0's (nothing of the diverged epoch is saved); the sweep records the trial
    as failed with the reason, and exits 1."""
    sweep_dir = tmp_path / "sweep"
    result = train(["-m", *poisoned(poison, options), f"hydra.sweep.dir={sweep_dir}"], home, expect_ok=False)
    assert result.returncode == 1, result.output[-3000:]
    last = sweep_dir / "0" / "checkpoints" / "last.ckpt"
    diverged = "raised TrainingDiverged: Training diverged at global step 21 (epoch 1, batch 4):"
    assert f"- rank 1 {diverged} {cause}." in result.output, result.output[-3000:]
    other = "the training loss or gradient norm was not finite on another rank"
    assert f"- rank 0 {diverged} {other}." in result.output, result.output[-3000:]
    assert f"The last checkpoint, saved before it: {last}" in result.output
    assert saved_epoch(last) == 0
    job = json.loads((sweep_dir / "0" / "result.json").read_text())
    assert job["status"] == "failed" and "Training diverged at global step 21 (epoch 1, batch 4)" in job["error"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "options, stopped",
    [
        ([], "the next step"),  # read when the next step is queued
        (["callbacks.model_checkpoint.every_n_train_steps=21"], "this step"),  # read at once: a save is due
    ],
    ids=["next-step", "save-due"],
)
def test_flags_read_a_step_late_name_the_diverged_step_and_no_checkpoint_holds_it(options, stopped, home, tmp_path):
    """step_checks=a_step_late (what GPU runs do): rank 1's NaN weights before step 21 are named as that step's,
    read after step 22 is queued (both ranks stop after it), or, where a checkpoint of step 21 is due, read before it
    is written: last.ckpt stays epoch 0's either way."""
    job_dir = tmp_path / "job"
    args = poisoned("PoisonWeights", ["step_checks=a_step_late", *options])
    result = train([*args, f"hydra.run.dir={job_dir}"], home, expect_ok=False)
    assert result.returncode == 1, result.output[-3000:]
    diverged = "raised TrainingDiverged: Training diverged at global step 21 (epoch 1, batch 4):"
    cause = "the training loss was not finite (rank 1's was nan)"
    assert f"- rank 1 {diverged} {cause}. Every rank stopped after {stopped}." in result.output, result.output[-3000:]
    assert saved_epoch(job_dir / "checkpoints" / "last.ckpt") == 0


def test_a_killed_worker_is_named_with_its_signal(home, tmp_path):
    exit_code, output, *_ = signal_rank_1(signal.SIGKILL, home, tmp_path)
    assert exit_code == 1
    assert "Training failed in the workers:\n- rank 1 was killed by SIGKILL." in output, output[-3000:]


def test_a_gradient_scaler_skipping_overflowing_steps_is_not_divergence():
    """Under ``16-mixed`` clipping, the GradScaler skips each step whose scaled gradients overflow and halves its
    scale: normal early in training, not divergence. From a scale of 2**100 the first steps all overflow; the run
    goes on, and trains once the scale has come down."""
    cfg = compose_train([*TINY, "trainer.gradient_clip_val=1.0"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)
    module = instantiate(cfg.model, net=build_net(cfg))
    trainer = fit(
        module,
        instantiate(cfg.data),
        epochs=-1,
        max_steps=120,
        limit_val_batches=0,
        gradient_clip_val=1.0,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler)],
        callbacks=[StopTogether()],
    )
    assert trainer.global_step == 120 and scaler.get_scale() < 2.0**60  # skipped steps, then real ones
    assert all(torch.isfinite(parameter).all() for parameter in module.parameters())
