"""Run ``python train.py <args>`` for many argument lists, each in a process of its own, cheaply.

``python tests/invocations.py CASES.json RESULTS.json``: CASES is a list of ``{"args": [...], "cwd": dir}``, each
run with ``dir`` as its working dir (where the user would have launched it). One process imports
what train.py imports (torch, Lightning, Hydra: most of a run's start-up time), then forks a child per case that
runs ``train.py`` as ``__main__`` with that ``sys.argv``, its stdout and stderr in files, and exits as the
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


def run_in_child(args: list[str], cwd: str, stdout: Path, stderr: Path) -> int:
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
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def main(cases_file: str, results_file: str) -> None:
    sys.path.insert(0, str(REPO))
    import project.launch  # noqa: F401  (what train.py imports when it runs: loaded once, before forking)

    results = []
    with tempfile.TemporaryDirectory() as tmp:  # outside the launch dirs, which the cases must leave empty
        stdout, stderr = Path(tmp) / "stdout", Path(tmp) / "stderr"
        for case in json.loads(Path(cases_file).read_text()):
            exit_code = run_in_child(case["args"], case["cwd"], stdout, stderr)
            results.append({"exit_code": exit_code, "stdout": stdout.read_text(), "stderr": stderr.read_text()})
    Path(results_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
