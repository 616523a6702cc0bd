"""End-to-end runs of ``python train.py`` (and torchrun) as users start them, read back from their W&B files."""

import csv
import json
import shutil

import pytest
import torch
import yaml
from conftest import EPOCH_KEYS, LOSS_KEYS, TINY, assert_close, assert_epoch_metrics, only_run, torchrun, train

pytestmark = pytest.mark.slow


def test_single_device_run_logs_every_epoch_to_wandb(single_run):
    run = only_run(single_run)
    assert run.exit_code == 0
    assert run.name == "mlp-auto-1dev-1node" and run.group == ""
    assert_epoch_metrics(run, epochs=3)
    # epoch is every key's x-axis but the step rows' (none here); each row also says the optimizer steps taken
    # (16 batches an epoch); the summary keeps each key's final value and its value in the best epoch.
    axes = {d.get("name", d.get("glob_name")): d["step_metric"] for d in run.metric_definitions if "step_metric" in d}
    assert axes == {"*": "epoch", "step/train_loss": "step"}
    assert run.series("step") == [16, 32, 48] and not run.series("step/train_loss")
    accuracy = run.series("val/acc")
    best = max(range(3), key=lambda epoch: accuracy[epoch])
    for key in EPOCH_KEYS:
        assert run.summary[key] == run.series(key)[-1] and run.summary[f"best/{key}"] == run.series(key)[best], key
    assert run.summary["best/epoch"] == best
    # The per-device table (W&B's own table file), here one device.
    table = json.loads((run.path / "files" / run.summary["devices"]["path"]).read_text())
    assert table["columns"][:2] == ["rank", "stage"] and len(table["data"]) == 1
    # The logged config is the resolved config, with the option picked in each group.
    assert run.config["choices"]["strategy"] == "auto" and run.config["choices"]["model"] == "mlp"
    assert run.job_type == "train" and "data.batch_size=64" in run.config["overrides"]
    assert run.config["trainer"]["devices"] == 1 and "${" not in str(run.config)
    # Learning happened.
    losses = run.series("train/loss")
    assert losses[-1] < losses[0] and run.series("val/acc")[-1] > 0.3  # chance: 0.1


def test_checkpoints_live_in_the_job_dir(single_run):
    checkpoints = sorted(p.name for p in (single_run / "checkpoints").iterdir())
    assert "last.ckpt" in checkpoints and "epoch002.ckpt" in checkpoints  # the best epoch by val/acc
    saved = yaml.safe_load((single_run / "config.yaml").read_text())
    assert saved["paths"]["output_dir"] == str(single_run)


def test_ddp_run_is_named_and_logged_per_epoch(ddp_fsdp_sweep):
    ddp = only_run(ddp_fsdp_sweep[0])
    assert ddp.name == "mlp-ddp-2dev-1node" and ddp.config["choices"]["strategy"] == "ddp"
    assert_epoch_metrics(ddp, epochs=3)
    # One row per device: DDP keeps the whole model state on each, the max over devices logged per epoch.
    table = json.loads((ddp.path / "files" / ddp.summary["devices"]["path"]).read_text())
    rows = [dict(zip(table["columns"], row)) for row in table["data"]]
    assert [row["rank"] for row in rows] == [0, 1]
    assert (
        rows[0]["memory/model_state_mb"] == rows[1]["memory/model_state_mb"] == ddp.series("memory/model_state_mb")[-1]
    )
    assert all(row["perf/samples_per_sec_per_device"] > 0 for row in rows)


def test_torchrun_launch_matches_the_builtin_launcher(runs_dir, home, ddp_fsdp_sweep):
    job_dir = runs_dir / "torchrun"
    result = torchrun(
        2,
        [
            *TINY,
            f"hydra.run.dir={job_dir}",
            "strategy=ddp",
            "trainer.devices=2",
            "data.batch_size=32",
            "strategy.timeout.minutes=7",
        ],
        home,
    )
    # The process group is made with the strategy's backend and timeout (read back from the group itself).
    assert "Process group: gloo, timeout 0:07:00, 2 ranks" in result.output
    run = only_run(job_dir)
    assert_epoch_metrics(run, epochs=3)
    assert_close(run.series("val/loss"), only_run(ddp_fsdp_sweep[0]).series("val/loss"), rel=1e-6)


def test_torchrun_runs_a_sweep(runs_dir, home):
    """`torchrun ... train.py -m ...`: every job of the sweep joins the one process group of the ranks."""
    sweep_dir = runs_dir / "torchrun-sweep"
    torchrun(
        2,
        ["-m", *TINY, f"hydra.sweep.dir={sweep_dir}", "strategy=ddp", "trainer.devices=2", "trainer.max_epochs=1,2"],
        home,
    )
    for job, epochs in [("0", 1), ("1", 2)]:
        run = only_run(sweep_dir / job)
        assert run.exit_code == 0
        assert_epoch_metrics(run, epochs=epochs)
        result = json.loads((sweep_dir / job / "result.json").read_text())  # rank 0's, read by rank 0's Hydra
        assert result["status"] == "completed" and result["epochs"] == epochs
        assert result["objective"] == max(run.series("val/acc"))
    assert (sweep_dir / "summary.md").read_text().count("| completed |") == 2  # written once, by rank 0


def test_multirun_with_ddp_runs_each_job_once(runs_dir, home):
    sweep_dir = runs_dir / "sweep"
    result = train(
        ["-m", *TINY, "trainer.max_epochs=2", f"hydra.sweep.dir={sweep_dir}", "strategy=ddp", "trainer.devices=1,2"],
        home,
        timeout=400,
    )
    assert result.output.count("Launching 2 jobs locally") == 1  # no worker started a sweep of its own
    jobs = sorted(p for p in sweep_dir.iterdir() if p.is_dir())
    assert [p.name for p in jobs] == ["0", "1"]
    runs = [only_run(job) for job in jobs]
    assert [r.name for r in runs] == ["mlp-ddp-1dev-1node", "mlp-ddp-2dev-1node"]
    assert {r.group for r in runs} == {sweep_dir.name} and {r.job_type for r in runs} == {"sweep"}
    assert [r.config["overrides"][-1] for r in runs] == ["trainer.devices=1", "trainer.devices=2"]  # each its own
    for run in runs:
        assert run.exit_code == 0
        assert_epoch_metrics(run, epochs=2)


def test_four_cpu_processes(runs_dir, home):
    job_dir = runs_dir / "ddp4"
    result = train(
        [*TINY, f"hydra.run.dir={job_dir}", "strategy=ddp", "trainer.devices=4", "trainer.max_epochs=1"], home
    )
    assert "Starting with 4 processes" in result.output
    assert_epoch_metrics(only_run(job_dir), epochs=1)


def test_resume_after_interruption_matches_the_uninterrupted_run(runs_dir, home, single_run):
    """A requeued job's command: ``ckpt_path=auto`` starts fresh where the job dir has no checkpoint, and resumes
    from its last.ckpt where it has one, continuing the same W&B run."""
    job_dir = runs_dir / "resumed"
    common = [*TINY, f"hydra.run.dir={job_dir}", "data.batch_size=64", "ckpt_path=auto"]
    train([*common, "trainer.max_epochs=1"], home)  # "interrupted" after epoch 1 of 3
    state = torch.load(job_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    assert state["epoch"] == 0
    first_part = only_run(job_dir)
    shutil.move(first_part.path, job_dir / "first-part")
    train([*common, "trainer.max_epochs=3"], home)  # resumed to epoch 3
    resumed, straight = only_run(job_dir), only_run(single_run)
    assert resumed.id == first_part.id and resumed.id != straight.id  # one W&B run, continued
    assert [row["epoch"] for row in resumed.history if "train/loss" in row] == [1, 2]
    for key in LOSS_KEYS:
        assert_close(first_part.series(key) + resumed.series(key), straight.series(key), rel=1e-6)


def test_resume_from_a_checkpoint_file(runs_dir, home, single_run):
    job_dir = runs_dir / "from-file"
    train(
        [*TINY, f"hydra.run.dir={job_dir}", "trainer.max_epochs=4", f"ckpt_path={single_run}/checkpoints/last.ckpt"],
        home,
    )
    assert [row["epoch"] for row in only_run(job_dir).history if "val/loss" in row] == [3]


@pytest.mark.parametrize("logger", ["csv", "none"])
def test_other_loggers(logger, runs_dir, home):
    job_dir = runs_dir / f"logger-{logger}"
    result = train([*TINY, f"hydra.run.dir={job_dir}", f"logger={logger}", "trainer.max_epochs=1"], home)
    assert not (job_dir / "wandb").exists()
    metrics_files = list(job_dir.glob("csv/version_*/metrics.csv"))
    if logger == "csv":
        with open(metrics_files[0]) as file:
            rows = list(csv.DictReader(file))
        assert len(rows) == 1 and rows[0]["epoch"] == "0"  # one row per epoch, training and validation together
        assert all(rows[0][key] for key in ("train/loss", "val/acc", "perf/samples_per_sec", "memory/model_state_mb"))
        assert f"CSV            {metrics_files[0]}" in result.output  # the end of the run says where it went
    else:
        assert not metrics_files


def test_default_run_learns_like_seed_002(runs_dir, home):
    """Plain `python train.py`: loss falls and accuracy rises every epoch; val accuracy >= 0.8 after 5 epochs."""
    job_dir = runs_dir / "default"
    result = train([f"hydra.run.dir={job_dir}"], home)
    # What the job trains, in three lines, not the whole config (print_config=full prints that)
    assert "Job: model=mlp (793,098 parameters), strategy=auto (data parallel 1) on 1 device(s) x 1 node(s)" in (
        result.output
    )
    assert "CONFIG" not in result.output
    assert "Epoch 4/4" in result.output and "· Epoch" not in result.output  # the Rich progress bar, no job label
    run = only_run(job_dir)
    assert_epoch_metrics(run, epochs=5)
    for key, sign in [("train/loss", -1), ("val/loss", -1), ("train/acc", 1), ("val/acc", 1)]:
        values = run.series(key)
        assert all(sign * (b - a) > 0 for a, b in zip(values, values[1:])), (key, values)
    assert run.series("val/acc")[-1] >= 0.8


@pytest.mark.slow
def test_model_state_memory_is_the_parameter_count_times_four_bytes(single_run):
    """The tiny MLP (32 -> 64 -> 32 -> 10) in float32 with SGD momentum: parameters, gradients and momentum buffers
    each hold (32*64 + 64 + 64*32 + 32 + 32*10 + 10) floats, counted here from the layer sizes, in every epoch."""
    mib = (32 * 64 + 64 + 64 * 32 + 32 + 32 * 10 + 10) * 4 / 2**20
    run = only_run(single_run)
    for key in ("memory/params_mb", "memory/grads_mb", "memory/optimizer_mb"):
        assert run.series(key) == [mib] * 3, key
    assert run.series("memory/model_state_mb") == [3 * mib] * 3


def test_fast_dev_run(runs_dir, home):
    job_dir = runs_dir / "fast-dev"
    result = train([*TINY, f"hydra.run.dir={job_dir}", "debug=fast_dev_run"], home)
    assert "Running in `fast_dev_run` mode: will run the requested loop using 1 batch(es)" in result.output
    assert not list(job_dir.glob("wandb/offline-run-*"))  # Lightning swaps the loggers for a dummy


def test_overfit_drives_the_training_loss_down(runs_dir, home):
    job_dir = runs_dir / "overfit"
    train([*TINY, f"hydra.run.dir={job_dir}", "debug=overfit", "trainer.max_epochs=30"], home)
    losses = only_run(job_dir).series("train/loss")
    assert len(losses) == 30 and losses[-1] < 0.05 * losses[0], losses


def test_seed_000_experiment(runs_dir, home):
    """experiment=seed_large_model: the 55M-parameter LargeModel, batch 10 per device, DDP on 2 devices (2 of its 3
    epochs, for time: each all-reduces and checkpoints 220 MB of parameters)."""
    job_dir = runs_dir / "seed-000"
    result = train(
        [f"hydra.run.dir={job_dir}", "experiment=seed_large_model", "print_config=false", "trainer.max_epochs=2"], home
    )
    assert "55.0 M" in result.output  # Lightning's parameter count of the seed model
    run = only_run(job_dir)
    assert run.name == "mlp-ddp-2dev-1node" and run.tags == ["seed_large_model"]
    assert_epoch_metrics(run, epochs=2)
    assert run.series("train/loss")[-1] < run.series("train/loss")[0]
