"""Run ``python train.py <args>`` for many argument lists, each in a process of its own, cheaply.

``python tests/invocations.py CASES.json RESULTS.json``: CASES is a list of ``{"args": [...], "cwd": dir}``, each
run with ``dir`` as its working dir (where the user would have launched it). One process imports
what train.py imports (torch, Lightning, Hydra: most of a run's start-up time), then forks a child per case (as
many at once as it has cores) that runs ``train.py`` as ``__main__`` with that ``sys.argv``, its stdout and stderr in files, and exits as the
interpreter would (a ``sys.exit("message")`` prints the message and exits 1; an uncaught exception prints its
traceback). RESULTS gets ``{"exit_code", "stdout", "stderr"}`` per case, in order.
"""

import json
import os
import runpy
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def start_child(args: list[str], cwd: str, stdout: Path, stderr: Path) -> int:
    """Fork a child that runs train.py with ``args`` in ``cwd``; returns its pid."""
    pid = os.fork()
    if pid == 0:
        os.chdir(cwd)
        for fd, path in ((1, stdout), (2, stderr)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        sys.argv = [str(REPO / "train.py"), *args]
        code = 0
        try:
            runpy.run_path(str(REPO / "train.py"), run_name="__main__")
        except SystemExit as exit:
            if isinstance(exit.code, str):
                print(exit.code, file=sys.stderr)
                code = 1
            else:
                code = exit.code or 0
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return pid


def main(cases_file: str, results_file: str) -> None:
    sys.path.insert(0, str(REPO))
    import project.launch  # noqa: F401  (what train.py imports when it runs: loaded once, before forking)

    cases = json.loads(Path(cases_file).read_text())
    results: list[dict | None] = [None] * len(cases)
    at_once = len(os.sched_getaffinity(0))  # a child per core: each case is a short CPU-bound process
    with tempfile.TemporaryDirectory() as tmp:  # outside the launch dirs, which the cases must leave empty
        running: dict[int, tuple[int, Path, Path]] = {}
        pending = list(enumerate(cases))
        while pending or running:
            while pending and len(running) < at_once:
                index, case = pending.pop(0)
                stdout, stderr = Path(tmp) / f"{index}.out", Path(tmp) / f"{index}.err"
                running[start_child(case["args"], case["cwd"], stdout, stderr)] = (index, stdout, stderr)
            pid, status = os.wait()
            index, stdout, stderr = running.pop(pid)
            results[index] = {"exit_code": os.waitstatus_to_exitcode(status), "stdout": stdout.read_text(),
                              "stderr": stderr.read_text()}
    Path(results_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
