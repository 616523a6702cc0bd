"""Imported first thing by every Python process the tests start (their PYTHONPATH holds tests/): in a run forked by
the preloaded server, a worker (``python -m project.launch.worker``, started by torchelastic) or a node task of
``launcher=slurm_local`` (``python -u -m submitit.core._submit``, started by submitit) becomes a proxy of the same
module run in a child of that server (``tests/helpers/preloaded.py``). Any other process goes on as usual."""

import os
import sys

PROXIED_MODULES = ("project.launch.worker", "submitit.core._submit")

# The variable is helpers.preloaded.MODULE_SERVER_VARIABLE, spelt out: importing that module costs every process.
server = os.environ.get("PROJECT_TEST_MODULE_SERVER")
if server and "-m" in sys.orig_argv:
    module_at = sys.orig_argv.index("-m") + 1
    if sys.orig_argv[module_at] in PROXIED_MODULES:
        from helpers.preloaded import proxy_module

        proxy_module(server, sys.orig_argv[module_at], sys.orig_argv[module_at + 1 :])
