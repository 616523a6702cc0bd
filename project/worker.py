"""A worker process of a multi-device job: ``python -m project.worker <job dir>/config.yaml``.

Started by ``project.launch.launch_workers`` with torchelastic's environment (RANK, WORLD_SIZE, MASTER_ADDR...).
"""

import sys

from omegaconf import OmegaConf
from torch.distributed.elastic.multiprocessing.errors import record

from project.training import train


@record  # writes this worker's traceback where the launcher can report it
def main(config_file: str) -> None:
    train(OmegaConf.load(config_file))


if __name__ == "__main__":
    main(sys.argv[1])
