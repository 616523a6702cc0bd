"""Train a model with Hydra-composed config: ``python train.py [group=option ...] [key=value ...]``.

See README.md; ``python train.py --help`` lists the config groups.
"""

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from project.config.overrides import check_overrides, explained_unknown_keys
from project.config.resolvers import register_resolvers
from project.launch.processes import torchrun_rank
from project.launch.results import record_failure
from project.options.errors import ConfigError, JobFailed, JobStopped, WriteFailed, exit_with

register_resolvers()


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | list[float | None] | None:
    from project.launch.launcher import is_rank_zero, report_stop, run  # here, so that --help and --cfg stay fast

    try:
        result = run(cfg)
    except JobStopped as stop:  # a preemption or Ctrl-C: the run, or the whole sweep, stops and says how to resume
        report_stop(cfg, stop)
    except (ConfigError, JobFailed) as error:
        if HydraConfig.get().mode != RunMode.MULTIRUN:
            if isinstance(error, ConfigError):
                exit_with(error)  # one paragraph naming key and fix, before any worker or W&B run starts
            if isinstance(error, WriteFailed):  # raised in this process: its path, cause and fix, once
                logging.getLogger(__name__).error(str(error))
            sys.exit(1)  # the failed job's report is on the console and in train.log
        # In a sweep, the job is recorded as failed (result.json, the summary) and the sweep goes on; None tells
        # Optuna the trial failed. The sweep's summary exits 1 at the end if any job failed.
        if is_rank_zero():
            record_failure(Path(cfg.paths.output_dir), error)
        return None
    # A sweeper (Optuna) reads the return value: the best value over epochs of optimized_metric, from the
    # result.json rank 0 wrote, however the job ran; with optimized_metric.also, a list, that value and the other
    # metrics of its epoch (a multi-objective search). None in torchrun's ranks other than 0.
    if result is None or not cfg.optimized_metric.get("also"):
        return None if result is None else result["objective"]
    best = result["best"] or {}
    return [result["objective"], *(best.get(name) for name in cfg.optimized_metric.also)]


if __name__ == "__main__":
    check_overrides(sys.argv[1:])  # a malformed override: one sentence, not Hydra's lexer report
    if torchrun_rank() > 0:
        # torchrun ranks > 0: only rank 0 keeps Hydra's log file and .hydra/ record of the job.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    with explained_unknown_keys():  # a misspelt key: the nearest key there is, not Hydra's advice to add it with +
        main()
