"""A worker process of a multi-device job: ``python -m project.worker <job dir>/config.yaml``.

Started by ``project.launch.launch_workers`` with torchelastic's environment (RANK, WORLD_SIZE, MASTER_ADDR...).
"""

import os
import sys

from project.processes import die_with_parent, start_heartbeat

die_with_parent()  # before the slow imports below, so that a launcher killed during start-up takes this along
start_heartbeat(int(os.environ["RANK"]))

from omegaconf import OmegaConf  # noqa: E402 (after die_with_parent)
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from project.training import train  # noqa: E402


@record  # writes this worker's traceback where the launcher can report it
def main(config_file: str) -> None:
    train(OmegaConf.load(config_file))


if __name__ == "__main__":
    main(sys.argv[1])
