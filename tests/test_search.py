"""Optuna searches on our sweeper (hydra_plugins/project_sweeper): trials pruned across ranks (ddp, fsdp and pipeline
x 2, under the basic, joblib and slurm_local launchers), one journal file written by jobs running at once, each
trial's W&B run grouped by study, and the study as optuna-dashboard shows it in headless Chromium.

Every number is checked against Optuna's own records (read with Optuna), the jobs' result.json, the W&B runs, and an
unpruned rerun of the best trial."""

import csv
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from html import unescape
from pathlib import Path

import pytest
from conftest import REPO, TINY, PreloadedRun, isolated_env, only_run, require_extra, train
from hydra.utils import instantiate
from test_config import compose_train
from test_report import CHROMIUM, CHROMIUM_FLAGS, render_report
from test_sweeps import log_span

# SGD at 0.1 and 0.05 trains; at 100 it diverges, kept finite by the clipping (a validation loss of 20 to 100, where
# the others have about 2.2), so the pruner, not the divergence stop, ends it. With seed 7 the TPE sampler's random
# start-up trials draw 0.1, 0.05, 100, 100: two that train, then two that diverge, which the median pruner, after 2
# complete trials, prunes at their first validation.
SEARCH = [
    *(item for item in TINY if not item.startswith(("model.optimizer.lr=", "data.num_train="))),
    "hparams_search=optuna",
    "model.optimizer.lr=choice(0.05,0.1,50,100)",
    "seed=7",
    "trainer.gradient_clip_val=1.0",
    "optimized_metric.name=val/loss",
    "optimized_metric.mode=min",
    "hydra.sweeper.pruner.n_startup_trials=2",
    "trainer.devices=2",
]
LEARNING_RATES = [0.1, 0.05, 100, 100]
DDP_SEARCH = [*SEARCH, "strategy=ddp", "data.num_train=16384"]


SWEEPER_OPTIONS = [
    f"hydra/sweeper/{path.parent.name}={path.stem}" for path in sorted((REPO / "conf/hydra/sweeper").glob("*/*.yaml"))
]


@pytest.mark.parametrize("option", SWEEPER_OPTIONS)
def test_every_sampler_and_pruner_option_is_optunas_own_object(option):
    """Each option of conf/hydra/sweeper/, composed as the command line composes it, builds Optuna's sampler or
    pruner with the options the file gives (the seed is the run's)."""
    optuna = require_extra("optuna", "optuna")
    cfg = compose_train(["hparams_search=optuna", "seed=11", option])
    group = option.removeprefix("hydra/sweeper/").split("=")[0]
    node = cfg.hydra.sweeper[group]
    built = instantiate(node)
    assert isinstance(built, optuna.samplers.BaseSampler if group == "sampler" else optuna.pruners.BasePruner)
    assert type(built).__name__ == node._target_.rsplit(".", 1)[1]
    if group == "sampler":
        assert node.seed == 11


def study_rows(sweep_dir: Path) -> tuple:
    """The study (Optuna's records, from the default journal file in the sweep dir) and the sweep's summary rows."""
    optuna = require_extra("optuna", "optuna")
    from optuna.storages.journal import JournalFileBackend

    journal = optuna.storages.JournalStorage(JournalFileBackend(str(sweep_dir / "optuna.journal")))
    study = optuna.load_study(study_name="train", storage=journal)
    with open(sweep_dir / "summary.csv") as file:
        return study, list(csv.DictReader(file))


def assert_pruned_search(sweep_dir: Path, trials: int) -> list[dict]:
    """One trial per job, numbered as the jobs and with their overrides; the two that train complete with their
    result's objective, the diverging ones are pruned after one epoch (reported: the first validation's loss), in
    the study, result.json and the summary alike. Returns the jobs' results."""
    optuna = require_extra("optuna", "optuna")
    study, rows = study_rows(sweep_dir)
    assert [trial.number for trial in study.trials] == [int(row["job"]) for row in rows] == list(range(trials))
    results = [json.loads((sweep_dir / row["job"] / "result.json").read_text()) for row in rows]
    for trial, row, result, lr in zip(study.trials, rows, results, LEARNING_RATES):
        assert trial.params == {"model.optimizer.lr": lr} and f"model.optimizer.lr={lr}" in row["overrides"].split()
        losses = [epoch["val/loss"] for epoch in result["history"]]
        assert trial.intermediate_values == pytest.approx(dict(enumerate(losses)), rel=1e-6)  # after each validation
        if lr == 100:
            assert trial.state == optuna.trial.TrialState.PRUNED and result["status"] == row["status"] == "pruned"
            assert result["epochs"] == 1 and losses[0] > 10
        else:
            assert trial.state == optuna.trial.TrialState.COMPLETE and result["status"] == row["status"] == "completed"
            assert result["epochs"] == 3 and trial.value == result["objective"] == min(losses) < 3
    assert study.best_trial.number == 0 and [row["best"] for row in rows] == ["True"] + ["False"] * (trials - 1)
    return results


@pytest.fixture(scope="module")
def ddp_search(runs_dir, home):
    """4 trials of ddp x 2, one at a time (the basic launcher), W&B runs offline; returns the sweep dir, output.
    16384 samples, so that an epoch (about 1 s here) outweighs the noise of a job's start-up."""
    require_extra("optuna", "optuna")
    sweep_dir = runs_dir / "pruned-search"
    result = train([*DDP_SEARCH, "hydra.sweeper.n_trials=4", f"hydra.sweep.dir={sweep_dir}"], home)
    return sweep_dir, result.output


@pytest.mark.slow
def test_diverging_ddp_trials_are_pruned_after_their_first_validation_and_end_sooner(ddp_search):
    sweep_dir, output = ddp_search
    results = assert_pruned_search(sweep_dir, 4)
    for number in (2, 3):
        assert f"Trial {number} pruned by optuna.pruners.MedianPruner after validation 0" in output
    assert "Study train: 4 trials (2 complete, 2 pruned)." in output and "jobs failed" not in output
    # sooner: one epoch where the others trained three (counted, not timed: a busy machine's clock once put a
    # pruned trial's 4.6 s above a complete one's 4.4 s)
    assert [result["epochs"] for result in results] == [3, 3, 1, 1]
    # every rank stopped after the same batch: the first epoch's last (16384 samples, 64 x 2 a step)
    for job in (2, 3):
        log = (sweep_dir / str(job) / "train.log").read_text()
        stops = re.findall(rf"\[rank (\d)\]\S* - Trial {job} pruned: this rank stops after global step (\d+)\.", log)
        assert sorted(stops) == [("0", "128"), ("1", "128")]
    assert re.search(rf"Browse the study: (\S*/)?optuna-dashboard {sweep_dir}/optuna.journal", output)


@pytest.mark.slow
def test_the_best_trial_equals_an_unpruned_rerun_of_it(ddp_search, runs_dir, home):
    sweep_dir, _ = ddp_search
    study, _ = study_rows(sweep_dir)
    best = json.loads((sweep_dir / str(study.best_trial.number) / "result.json").read_text())
    rerun_dir = runs_dir / "pruned-search-rerun"
    plain = [item for item in DDP_SEARCH if not item.startswith(("hparams_search=", "model.optimizer.lr=", "hydra."))]
    lr = study.best_trial.params["model.optimizer.lr"]
    train([*plain, f"model.optimizer.lr={lr}", "logger=csv", f"hydra.run.dir={rerun_dir}"], home)
    rerun = json.loads((rerun_dir / "result.json").read_text())
    assert math.isclose(rerun["objective"], study.best_value, rel_tol=1e-6)
    for key in ("train/loss", "val/loss"):
        assert [e[key] for e in rerun["history"]] == pytest.approx([e[key] for e in best["history"]], rel=1e-6)


@pytest.mark.slow
def test_each_trials_wandb_run_is_grouped_by_study_with_its_number_and_params(ddp_search):
    sweep_dir, _ = ddp_search
    study, _ = study_rows(sweep_dir)
    for trial in study.trials:
        run = only_run(sweep_dir / str(trial.number))
        assert run.group == "train"
        assert run.config["trial"]["number"] == trial.number and run.config["trial"]["params"] == trial.params
        assert len(run.series("val/loss")) == len(trial.intermediate_values)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("launcher", "strategy"),
    [("joblib", "fsdp"), ("slurm_local", "pipeline")],
    ids=["joblib-fsdp", "slurm_local-pipeline"],
)
def test_trials_run_two_at_a_time_write_one_journal_and_are_pruned(launcher, strategy, runs_dir, home):
    """Trials 0 and 1 run at once, each reporting every validation to the journal file while the other does; then
    trial 2 diverges and is pruned. No trial is lost or numbered twice."""
    require_extra("optuna", "optuna")
    sweep_dir = runs_dir / f"pruned-search-{launcher}"
    train(
        [
            *SEARCH,
            "data.num_train=1024",
            f"launcher={launcher}",
            f"strategy={strategy}",
            "logger=csv",
            "hydra.sweeper.n_trials=3",
            "hydra.sweeper.n_jobs=2",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        home,
        timeout=400,
    )
    assert_pruned_search(sweep_dir, 3)
    first, second = (log_span(sweep_dir / str(job)) for job in (0, 1))
    assert first[0] < second[1] and second[0] < first[1]  # they overlapped


@pytest.mark.slow
def test_a_multi_objective_search_returns_each_jobs_objective_and_the_other_metrics_of_its_best_epoch(runs_dir, home):
    """NSGA-II over two objectives: the lowest validation loss, and the accuracy of that epoch."""
    optuna = require_extra("optuna", "optuna")
    sweep_dir = runs_dir / "multi-objective"
    searched = [item for item in SEARCH if not item.startswith(("hydra.sweeper.pruner", "trainer.devices"))]
    output = train(
        [
            *searched,
            "data.num_train=1024",
            "logger=csv",
            "hydra/sweeper/sampler=nsgaii",
            "hydra.sweeper.pruner=null",
            "hydra.sweeper.direction=[minimize,maximize]",
            "optimized_metric.also=[val/acc]",
            "hydra.sweeper.n_trials=2",
            f"hydra.sweep.dir={sweep_dir}",
        ],
        home,
    ).output
    study, rows = study_rows(sweep_dir)
    assert [trial.state for trial in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for trial in study.trials:
        result = json.loads((sweep_dir / str(trial.number) / "result.json").read_text())
        assert trial.values == [result["objective"], result["best"]["val/acc"]]
        assert result["best"]["val/loss"] == min(epoch["val/loss"] for epoch in result["history"])
    front = sorted(trial.number for trial in study.best_trials)
    assert front and f"Pareto front: trials {front}" in output


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rendered_text(url: str, out: Path, screenshot: Path | None = None) -> str:
    """The page's visible text once Chromium has run its scripts (optuna-dashboard is a single-page app)."""
    browser = [CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={out / 'chromium'}", "--window-size=1400,1000"]
    dom = subprocess.run([*browser, "--dump-dom", url], capture_output=True, text=True, timeout=120).stdout
    if screenshot is not None:
        subprocess.run([*browser, f"--screenshot={screenshot}", url], capture_output=True, timeout=120)
    dom = re.sub(r"<(style|script|svg)\b.*?</\1>", " ", dom, flags=re.S)
    return " ".join(unescape(re.sub(r"<[^>]+>", " ", dom)).split())


@pytest.mark.slow
def test_optuna_dashboard_shows_every_trial_and_the_best_params_in_chromium(ddp_search, tmp_path):
    if CHROMIUM is None:
        assert not os.environ.get("CI"), ".ci/run installs Debian's chromium for this test"
        pytest.skip("no chromium on this machine (apt-get install chromium)")
    sweep_dir, _ = ddp_search
    study, _ = study_rows(sweep_dir)
    port = free_port()
    dashboard = Path(sys.executable).parent / "optuna-dashboard"
    server = subprocess.Popen(
        [str(dashboard), str(sweep_dir / "optuna.journal"), "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        env=isolated_env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None and time.monotonic() < deadline, "optuna-dashboard did not start"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        base = f"http://127.0.0.1:{port}/dashboard/studies/{study._study_id}"
        page = rendered_text(base, tmp_path, screenshot=tmp_path / "dashboard.png")
        best = study.best_trial
        assert f"Best Trial (number={best.number}) {best.value} Params = [model.optimizer.lr: 0.1]" in page
        numbers = ",".join(str(trial.number) for trial in study.trials)
        trials = rendered_text(f"{base}/trials?numbers={numbers}", tmp_path)
        for trial in study.trials:
            state = trial.state.name.capitalize()
            assert f"Trial {trial.number} (trial_id={trial._trial_id}) {state}" in trials
            assert re.search(
                rf"Trial {trial.number} \(trial_id=\d+\) {state} (Best Trial )?Note Value {trial.value}\b", trials
            )
        assert (tmp_path / "dashboard.png").stat().st_size > 20_000
    finally:
        server.terminate()
        server.wait(timeout=30)


def luminance(rgb: str) -> float:
    """Relative luminance (WCAG) of ``rgb(r, g, b)``: Viridis, the report's scale, rises in it from end to end."""
    channels = [int(c) / 255 for c in re.findall(r"\d+", rgb)]
    linear = [c / 12.92 if c <= 0.04045 else ((c + 0.055) / 1.055) ** 2.4 for c in channels]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


@pytest.mark.slow
def test_the_report_colours_trials_by_objective_and_shows_the_completed_ones_alone(ddp_search, tmp_path, home):
    """One render, filtered to the completed trials: those two rows alone, and the lower the loss, the darker the
    line (relative luminance; Viridis, the report's scale, rises in it from end to end)."""
    sweep_dir, _ = ddp_search
    study, _ = study_rows(sweep_dir)
    charts = render_report(sweep_dir, tmp_path, ["--status", "completed"], home, screenshot=False)
    header, *rows = charts.table
    assert [row[header.index("status")] for row in rows] == ["completed", "completed"]
    assert charts.legend["curve-val-loss"] == ["0: model.optimizer.lr=0.1", "1: model.optimizer.lr=0.05"]
    strokes = charts.strokes["curve-val-loss"]  # a line per completed trial, in job order
    best, other = sorted(study.trials[:2], key=lambda trial: trial.value)
    assert best.value < other.value and luminance(strokes[best.number]) < luminance(strokes[other.number])


@pytest.mark.slow
def test_a_study_is_continued_only_by_its_own_search_for_its_own_objective_with_new_parameters(tmp_path, home):
    """Search A (2 trials, one journal shared by path) is training when search B, in another sweep dir, names the
    same study: B is refused before any trial, naming A as running, and A ends with its 2 trials completed (B used
    to mark A's running trial failed, and A then died telling it). Continuing A with another direction or metric is
    refused; with n_trials=4 it runs 2 new trials whose parameters are not the first two's (a seeded sampler used to
    ask them again)."""
    optuna = require_extra("optuna", "optuna")
    storage = tmp_path / "shared.journal"
    search = [
        *(item for item in TINY if not item.startswith("model.optimizer.lr=")),
        "hparams_search=optuna",
        "model.optimizer.lr=interval(0.01,0.3)",
        "model.net.hidden_dims=choice([64,32],[32,32],[16,16])",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.study_name=shared",
        "hydra.sweeper.n_trials=2",
    ]
    first = [*search, f"hydra.sweep.dir={tmp_path / 'a'}"]
    running = PreloadedRun(
        [*first, "+callbacks.slow._target_=helpers.probes.SlowEpochs", "+callbacks.slow.seconds=2"], home
    )
    deadline = time.monotonic() + 300
    while not (tmp_path / "a" / "0" / "result.json").exists():  # trial 0 has trained an epoch
        assert time.monotonic() < deadline and running.poll() is None, running.communicate()[0][-3000:]
        time.sleep(0.1)
    other = train([*search, f"hydra.sweep.dir={tmp_path / 'b'}"], home, expect_ok=False)
    assert other.returncode == 1 and "Traceback" not in other.output, other.output[-3000:]
    assert (
        f"Config error: hydra.sweeper.study_name: names study shared in {storage}, whose trials are the jobs of the "
        f"search in {tmp_path / 'a'}, running now (pid {running.pid}" in other.output
    )
    assert "Fix: give this search its own study name (hydra.sweeper.study_name=...), or continue that one" in (
        other.output
    )
    assert not list((tmp_path / "b").glob("[0-9]*"))  # no trial of its own either
    output, _ = running.communicate(timeout=300)
    assert running.returncode == 0, output[-3000:]
    study = optuna.load_study(
        study_name="shared",
        storage=optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(storage))),
    )
    assert [trial.state for trial in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2

    for changed, key in (
        ("optimized_metric.name=val/loss", "optimized_metric.name"),
        ("optimized_metric.mode=min", "hydra.sweeper.direction"),
    ):
        refused = train([*first, changed], home, expect_ok=False)
        assert refused.returncode == 1 and f"Config error: {key}: " in refused.output, refused.output[-3000:]
        assert "its values would not compare" in refused.output
    assert len(optuna.load_study(study_name="shared", storage=study._storage).trials) == 2

    train([*first, "hydra.sweeper.n_trials=4"], home)
    trials = optuna.load_study(study_name="shared", storage=study._storage).trials
    assert [trial.state for trial in trials] == [optuna.trial.TrialState.COMPLETE] * 4
    first_lrs = {trial.params["model.optimizer.lr"] for trial in trials[:2]}
    assert not first_lrs & {trial.params["model.optimizer.lr"] for trial in trials[2:]}
