"""Imported first thing by every Python process the tests start (their PYTHONPATH holds tests/): in a run forked by
the preloaded server, a process the run starts becomes a proxy of the same program run in a child of that server
(``tests/helpers/preloaded.py``), when it is one of those ``PROXIED`` names: a worker (started by torchelastic), a
``torchrun`` rank (``python -u train.py``), a node task of ``launcher=slurm_local`` (started by submitit). Any
other process goes on as usual."""

import os
import sys

from helpers.command_line import split_command

PROXIED = (["-m", "project.launch.worker"], ["-m", "submitit.core._submit"], ["train.py"])


# The variable is helpers.preloaded.PROGRAM_SERVER_VARIABLE, spelt out: importing that module costs every process.
server = os.environ.get("PROJECT_TEST_PROGRAM_SERVER")
if server:
    command, arguments = split_command(sys.orig_argv[1:])
    if [os.path.basename(part) for part in command] in PROXIED:
        from helpers.preloaded import proxy_program

        proxy_program(server, command, arguments)
