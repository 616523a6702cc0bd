"""``python train.py <args>`` without paying its imports each time: a server that has imported what train.py imports
(torch, Lightning, Hydra: most of a tiny run's start-up; ``benchmarks/preloaded_start.py``) forks a child per run.

``python tests/helpers/preloaded.py``, started with the environment its runs are to have, reads one JSON request per
line on
stdin, ``{"args": [...], "cwd": dir, "stdout": file, "stderr": file}``, forks a child for it at once and answers
``{"pid": pid}``; when a child ends it answers ``{"exited": pid, "exit_code": code}``. The child runs ``train.py`` as
``__main__`` with that ``sys.argv`` and working dir, at module level (no frame of the server left to unwind), and
ends as the interpreter would: a ``SystemExit``'s code (its message printed), an uncaught exception's traceback and
exit code 1, non-daemon threads joined, atexit handlers run, the standard streams flushed. Only the interpreter's
teardown of its modules (1.4 s with torch and Lightning loaded, and nothing a run writes) is skipped. The run's
workers, W&B service and sweep jobs are processes it starts as any launcher does. The server holds no thread and no
open file but its pipes when it forks.
"""

import atexit
import json
import os
import runpy
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def reap() -> None:
    """Answer for every child that has ended."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return
        if pid == 0:
            return
        answer({"exited": pid, "exit_code": os.waitstatus_to_exitcode(status)})


def serve() -> dict | None:
    """The server's loop; returns in each forked child, with the request it is to run (None: stdin closed)."""
    sys.path[0] = str(REPO)  # as for ``python train.py``: the script's dir first, not this one's
    import project.launch.launcher  # noqa: F401  (what train.py imports when it runs: loaded once, before forking)

    assert threading.active_count() == 1, threading.enumerate()  # a fork keeps only the forking thread
    pending = b""  # read from stdin, not yet a whole request
    while True:
        if b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                return request
            answer({"pid": pid})
        elif select.select([0], [], [], 0.02)[0]:
            chunk = os.read(0, 65536)
            if not chunk:
                return None
            pending += chunk
        reap()


def become_train(request: dict) -> None:
    """In the child: the working dir, standard streams and argv of ``python train.py <args>`` launched there."""
    os.chdir(request["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (train.py's stdin for the rest of the child's life)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = [str(REPO / "train.py"), *request["args"]]


def exit_code(exit: SystemExit) -> int:
    """What the interpreter makes of an uncaught ``SystemExit``: None is 0, a number its low byte, anything else
    is printed and gives 1."""
    if exit.code is None:
        return 0
    if isinstance(exit.code, int):
        return exit.code & 0xFF
    print(exit.code, file=sys.stderr)
    return 1


def end(code: int) -> None:
    """End the child as the interpreter ends a script, but for the teardown of its modules."""
    threading._shutdown()  # the interpreter's own step: threading's atexit hooks (executors), non-daemon threads joined
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class TrainServer:
    """The test's side: a running server for one environment (``env``: the runs' HOME and variables)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.pending = b""
        self.exit_codes: dict[int, int] = {}  # children that ended and were not waited for yet

    def start(self, args: list[str], cwd: Path, stdout: Path, stderr: Path) -> int:
        """Fork a ``python train.py <args>`` in ``cwd``, its output in the files ``stdout`` and ``stderr``; its pid."""
        request = {"args": args, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        self.process.stdin.flush()
        while True:
            message = self._next_message(timeout=60)
            if message is None:
                raise RuntimeError("the preloaded train.py server did not fork within 60 s")
            if "pid" in message:
                return message["pid"]

    def wait(self, pid: int | None = None, timeout: float = 300) -> tuple[int, int] | None:
        """(pid, exit code) of child ``pid`` (None: of any child) once it has ended; None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while True:
            ended = next((child for child in self.exit_codes if pid in (None, child)), None)
            if ended is not None:
                return ended, self.exit_codes.pop(ended)
            left = deadline - time.monotonic()
            if left <= 0 or self._next_message(timeout=left) is None:
                return None

    def close(self) -> None:
        self.process.stdin.close()  # the server's loop ends at the end of its input
        self.process.wait(timeout=60)
        self.process.stdout.close()

    def _next_message(self, timeout: float) -> dict | None:
        """The server's next answer (an ``exited`` one also noted in ``exit_codes``); None after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.process.stdout], [], [], left)[0]:
                return None
            chunk = os.read(self.process.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the preloaded train.py server exited with {self.process.wait()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        message = json.loads(line)
        if "exited" in message:
            self.exit_codes[message["exited"]] = message["exit_code"]
        return message


if __name__ == "__main__":
    request = serve()
    if request is not None:
        become_train(request)
        try:
            runpy.run_path(str(REPO / "train.py"), run_name="__main__")
            code = 0
        except SystemExit as exit:
            code = exit_code(exit)
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        end(code)
