"""Train a model with Hydra-composed config: ``python train.py [group=option ...] [key=value ...]``.

See README.md; ``python train.py --help`` lists the config groups.
"""

import os
import sys

import hydra
from omegaconf import DictConfig

from project.errors import ConfigError, exit_with


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from project.launch import run  # imported here so that --help and --cfg stay fast

    try:
        result = run(cfg)
    except ConfigError as error:
        exit_with(error)  # one paragraph naming key and fix; raised before any worker or W&B run starts
    # A sweeper (Optuna) reads the return value: the best value over epochs of optimized_metric, from the
    # result.json rank 0 wrote, however the job ran. None in torchrun's ranks other than 0.
    return None if result is None else result["objective"]


if __name__ == "__main__":
    if int(os.environ.get("RANK", "0")) > 0 and "TORCHELASTIC_RUN_ID" in os.environ:
        # torchrun ranks > 0: only rank 0 keeps Hydra's log file and .hydra/ record of the job.
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    main()
