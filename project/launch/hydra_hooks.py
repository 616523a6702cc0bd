"""Hydra callbacks of ``train.py``: checks before Hydra makes a job dir, and a sweep's summary. Light imports only."""

import shutil
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from project.config.overrides import check_swept_keys
from project.launch.job_dir import hold_job_dir
from project.launch.processes import torchrun_rank
from project.launch.results import print_sweep_summary
from project.options.errors import ConfigError, exit_with, made_dir


class JobDirCheck(Callback):
    """A run's (or sweep's) dir must be named and creatable, and free: Hydra would otherwise write into the launch
    dir, fail with a traceback, or rewrite a running job's ``.hydra/`` record and log, before any of the job's own
    checks. The dir's lock (``project.launch.job_dir``) is taken here, before Hydra writes into it, and held until
    the process ends; under torchrun by rank 0 alone."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _check_dir(config.hydra.run.dir, "hydra.run.dir")
        if torchrun_rank() == 0:
            keep_records(Path(config.hydra.run.dir))

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        check_swept_keys(config)
        _check_launcher(config.hydra.launcher)
        _check_dir(config.hydra.sweep.dir, "hydra.sweep.dir")
        if torchrun_rank() == 0:
            for job_dir in Path(config.hydra.sweep.dir).iterdir():
                keep_records(job_dir)


def keep_records(job_dir: Path) -> None:
    """A job dir run again (a resume, a continued sweep) keeps what each earlier attempt ran with: Hydra's
    ``.hydra/*.yaml`` and the job's resolved ``config.yaml``, copied into ``.hydra/attempts/<n>/`` before they are
    rewritten (Hydra writes its own before any job code runs, so this is done as the run or sweep starts)."""
    hydra_dir = job_dir / ".hydra"
    if not (hydra_dir / "overrides.yaml").is_file():
        return
    attempts = hydra_dir / "attempts"
    target = attempts / str(len(list(attempts.iterdir())) if attempts.is_dir() else 0)
    target.mkdir(parents=True)
    for source, name in [(hydra_dir / n, n) for n in ("config.yaml", "hydra.yaml", "overrides.yaml")] + [
        (job_dir / "config.yaml", "job_config.yaml")
    ]:
        if source.is_file():
            shutil.copyfile(source, target / name)


def _check_launcher(launcher: DictConfig) -> None:
    """Launcher settings this machine cannot honour, refused before the sweep makes its dir (the launchers would
    raise from their own depths)."""
    target = str(launcher.get("_target_", ""))
    if target.endswith("SlurmLauncher") and shutil.which("srun") is None:
        exit_with(
            ConfigError(
                "launcher",
                "is slurm, but this machine has no SLURM (no srun on the PATH) to submit the jobs to.",
                "run the sweep on the cluster's login node, or use launcher=slurm_local to run its jobs here as "
                "SLURM would.",
            )
        )
    n_jobs = launcher.get("n_jobs")
    if target.endswith("JoblibLauncher") and (isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0):
        exit_with(
            ConfigError(
                "hydra.launcher.n_jobs",
                f"is {n_jobs!r}: joblib runs N jobs at once for N > 0, or one per core for -1 (all but N-1 for -N).",
                "use hydra.launcher.n_jobs=2, say, or -1.",
            )
        )
    backend = launcher.get("backend")
    if target.endswith("JoblibLauncher") and backend is not None:
        from joblib.parallel import BACKENDS  # joblib would fall back to loky without a word

        if backend not in BACKENDS:
            exit_with(
                ConfigError(
                    "hydra.launcher.backend",
                    f"is {backend!r}, which joblib does not know.",
                    f"use one of {', '.join(sorted(BACKENDS))}, or leave it unset (loky: a process a job).",
                )
            )


def _check_dir(path: str | None, key: str) -> None:
    fix = "name a dir you can write to, or leave the key unset for a new dir under logs/."
    if path is None or not str(path).strip():
        exit_with(ConfigError(key, "is empty, so the job would write into the dir it was launched from.", fix))
    try:
        made_dir(key, path, fix)  # what Hydra does next; here a failure gets a clear message
        if torchrun_rank() == 0:
            hold_job_dir(path, key)
    except ConfigError as error:
        exit_with(error)


class SweepSummary(Callback):
    """At the end of a multirun: a table of its jobs (overrides, objective, best epoch, final value, runtime, status,
    the best job marked), printed and written to the sweep dir as ``summary.csv`` and ``summary.md``."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if torchrun_rank() > 0:
            return  # under torchrun every rank ran the sweep; rank 0 summarises it
        failed, jobs = print_sweep_summary(Path(config.hydra.sweep.dir))
        if failed:
            sys.exit(f"{failed} of {jobs} jobs failed; see the summary above and their train.log files.")
