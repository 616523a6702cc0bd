"""The tests' Python processes without paying their imports each time: a server that has imported what train.py and
its workers import (torch, Lightning, Hydra: most of a tiny run's start-up; ``benchmarks/preloaded_start.py``)
forks a child per process.

A *program* is what follows ``python``: ``["train.py"]`` (a script) or ``["-m", "project.launch.worker"]`` (a
module). A forked child runs its program as ``__main__`` with that ``sys.argv``, working dir and standard streams,
at module level (no frame of the server left to unwind), and ends as the interpreter would: a ``SystemExit``'s code
(its message printed), an uncaught exception's traceback and exit code 1, non-daemon threads joined, atexit
handlers run, the standard streams flushed. Only the interpreter's teardown of its modules (1.4 s with torch and
Lightning loaded, and nothing a run writes) is skipped. The server holds no thread and no open file but its pipes
and sockets when it forks.

The tests ask for processes on the server's stdin, one JSON request a line: ``{"program": [...], "args": [...],
"cwd": dir, "stdout": file, "stderr": file}`` (``"fresh_workers": true``: the run's workers start from scratch, not
forked: for the tests of process trees). It forks a child at once and answers ``{"pid": pid}``; when a child ends
it answers ``{"exited": pid, "exit_code": code}``.

The processes those runs start are forked from the server too (``tests/sitecustomize.py`` names which: the workers
that torchelastic starts, ``torchrun``'s ranks, the node tasks of ``launcher=slurm_local``). The server listens on
a Unix socket, named to its children in ``PROGRAM_SERVER_VARIABLE``, and ``tests/sitecustomize.py`` turns each such
process, as it starts, into a proxy (``proxy_program``). The proxy hands the server its program, arguments,
standard streams, working dir and environment; the server forks a child that runs the program in them; the proxy
passes on the signals it gets (torchelastic's SIGTERM, a user's SIGINT...), and ends as the child ends, with its
exit code or by its signal, so that torchelastic (or submitit) sees the process it started. The child dies with its
proxy (``watch_proxy``), and the proxy with its parent, as a worker dies with its launcher (``die_with_parent``).
What differs from a process started from scratch: its pid is not its starter's child's, and a job's ranks share one
string hash seed. So the tests of signals and process trees (``tests/test_faults.py``) ask for fresh workers.
"""

import atexit
import contextlib
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TRAIN = [str(REPO / "train.py")]  # the program of python train.py
# What train.py, its workers and submitit's tasks import, and the runs of the tests use (strategies, models, data):
# most of what a run imports before its first step. Not wandb, whose import makes a temporary dir that the first
# child to end deletes.
PRELOADED = [
    "project.launch.launcher",
    "submitit.core.submission",
    "project.launch.training",
    "project.observability.console",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.distributed.run",
    "project.data.datamodule",
    "project.tasks.classification",
    "project.tasks.language_model",
]
# The server's Unix socket, for the processes of the runs it forks (set by the server in its own environment).
PROGRAM_SERVER_VARIABLE = "PROJECT_TEST_PROGRAM_SERVER"
# What a proxy passes on to its child: what torchelastic, SLURM or a user send a worker, but SIGSTOP and SIGKILL,
# which no process can catch (a SIGKILLed proxy takes its child along: ``watch_proxy``).
RELAYED_SIGNALS = [
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCONT,
]


def answer(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def reap(proxied: dict[int, socket.socket]) -> None:
    """Answer for every child that has ended: a proxied one's proxy with its wait status, the tests with an exit
    code."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return
        if pid == 0:
            return
        proxy = proxied.pop(pid, None)
        if proxy is None:
            answer({"exited": pid, "exit_code": os.waitstatus_to_exitcode(status)})
            continue
        # OSError: the proxy is gone (killed), and so the child was killed by watch_proxy
        with proxy, contextlib.suppress(OSError):
            proxy.sendall(f"{status}\n".encode())


def program_listener() -> socket.socket:
    """The socket the proxies connect to, named to this process's children in ``PROGRAM_SERVER_VARIABLE``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    address = Path(tempfile.mkdtemp(prefix="preloaded-")) / "programs"  # short: a socket's path has at most 107 bytes
    listener.bind(str(address))
    listener.listen(64)
    os.environ[PROGRAM_SERVER_VARIABLE] = str(address)
    return listener


def receive_proxied(proxy: socket.socket) -> dict:
    """A proxy's request: its program, arguments, working dir and environment, and its standard streams as
    ``fds``."""
    data, fds, _, _ = socket.recv_fds(proxy, 1 << 20, 3)
    while not data.endswith(b"\n"):
        chunk = proxy.recv(1 << 20)
        if not chunk:
            raise ConnectionError("a proxy hung up before its request was whole")
        data += chunk
    return {**json.loads(data), "fds": fds, "proxy": proxy}


def warm_hydra() -> None:
    """Compose the train config once, before forking: each child then finds Hydra's plugins discovered (an import of
    every ``hydra_plugins`` module) and its config machinery loaded, as it would on its second composition."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        compose("train", return_hydra_config=True)


def serve() -> tuple[str, dict] | None:
    """The server's loop; returns in each forked child what it is to become (``"requested"``: the tests asked for
    it, ``"proxied"``: a proxy did) and its request (None: stdin closed)."""
    sys.path[0] = str(REPO)  # as for ``python train.py``: the script's dir first, not this one's
    for module in PRELOADED:  # loaded once, before forking
        importlib.import_module(module)
    warm_hydra()

    listener = program_listener()
    proxied: dict[int, socket.socket] = {}  # a child's pid: its proxy's connection
    assert threading.active_count() == 1, threading.enumerate()  # a fork keeps only the forking thread
    pending = b""  # read from stdin, not yet a whole request
    while True:
        child: tuple[str, dict] | None = None
        if b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            child = ("requested", json.loads(line))
        ready = select.select([0, listener], [], [], 0.02)[0] if child is None else []
        if listener in ready:
            child = ("proxied", receive_proxied(listener.accept()[0]))
        if child is not None:
            pid = os.fork()
            if pid == 0:
                listener.close()  # the child's own proxy connection is in its request; no other is its
                for proxy in proxied.values():
                    proxy.close()
                return child
            if child[0] == "requested":
                answer({"pid": pid})
            else:
                for fd in child[1]["fds"]:
                    os.close(fd)
                child[1]["proxy"].sendall(f"{pid}\n".encode())
                proxied[pid] = child[1]["proxy"]
        if 0 in ready:
            chunk = os.read(0, 65536)
            if not chunk:
                listener.close()
                Path(os.environ[PROGRAM_SERVER_VARIABLE]).unlink()
                return None
            pending += chunk
        reap(proxied)


def become_requested(request: dict) -> None:
    """In the child: the working dir and standard streams of the program the tests asked for (stdin empty)."""
    os.chdir(request["cwd"])
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the program's stdin for the rest of the child's life)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):  # appended to: they may be one file
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    if request.get("fresh_workers"):
        del os.environ[PROGRAM_SERVER_VARIABLE]  # its processes are started as they would be without the server


def watch_proxy(proxy: socket.socket) -> None:
    """Die with the proxy: it sends nothing more, so the read ends when its end of the connection closes."""
    try:
        while proxy.recv(1):
            pass
    finally:
        os.kill(os.getpid(), signal.SIGKILL)


def become_proxied(request: dict) -> None:
    """In the child: the standard streams, working dir and environment of the proxy; the child dies with it."""
    import torch

    from project.launch.processes import LAUNCHER_PID_VARIABLE

    for target, fd in enumerate(request["fds"]):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # A worker's die_with_parent() checks the launcher is its parent: the proxy did (torchelastic's launcher is).
    os.environ.pop(LAUNCHER_PID_VARIABLE, None)
    if "OMP_NUM_THREADS" in os.environ:  # read by a fresh torch when it starts; this one started in the server
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    threading.Thread(target=watch_proxy, args=(request["proxy"],), name="watch-proxy", daemon=True).start()


def proxy_program(server: str, program: list[str], args: list[str]) -> None:
    """Be the process ``python <program> <args>`` that torchelastic (or submitit) started, while the program runs
    in a child of the preloaded ``server``: pass on its signals, and end as it ends. Called by
    ``tests/sitecustomize.py`` as this process starts; never returns."""
    signal.pthread_sigmask(signal.SIG_BLOCK, RELAYED_SIGNALS)  # held until the child's pid is known
    from project.launch.processes import die_with_parent

    die_with_parent()  # what a worker does first: this process dies with its parent, and the child with it
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.connect(server)
    request = {"program": program, "args": args, "cwd": os.getcwd(), "env": dict(os.environ)}
    socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
    answers = connection.makefile("rb")
    child = int(answers.readline())

    def relay(signum: int, frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):  # it has ended; its status is on the way
            os.kill(child, signum)

    for signum in RELAYED_SIGNALS:
        signal.signal(signum, relay)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELAYED_SIGNALS)
    status = answers.readline()
    if not status:
        print(f"tests/helpers/preloaded.py: the server ended before {' '.join(program)}", file=sys.stderr)
        os._exit(1)
    code = os.waitstatus_to_exitcode(int(status))
    if code < 0:  # killed by a signal: so is this process
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal it survives (SIGCONT): the shell's code for it
    os._exit(code)


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


def run_program(program: list[str], args: list[str]) -> None:
    """``python <program> <args>`` in this process: the script or module as ``__main__``, ``sys.argv`` and
    ``sys.path[0]`` as the interpreter sets them, then ended as the interpreter ends (``end``)."""
    if program[0] == "-m":
        sys.argv, sys.path[0] = ["-m", *args], os.getcwd()
        run = lambda: runpy.run_module(program[1], run_name="__main__", alter_sys=True)  # noqa: E731
    else:
        script = Path(program[0]).absolute()
        sys.argv, sys.path[0] = [str(script), *args], str(script.parent)
        run = lambda: runpy.run_path(str(script), run_name="__main__")  # noqa: E731
    try:
        run()
        code = 0
    except SystemExit as exit:
        code = exit_code(exit)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    end(code)


class TrainServer:
    """The test's side: a running server for one environment (``env``: the runs' HOME and variables)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.process = subprocess.Popen(
            [sys.executable, __file__], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.pending = b""
        self.exit_codes: dict[int, int] = {}  # children that ended and were not waited for yet

    def start(
        self,
        args: list[str],
        cwd: Path,
        stdout: Path,
        stderr: Path,
        program: list[str] = TRAIN,
        fresh_workers: bool = False,
    ) -> int:
        """Fork a ``python <program> <args>`` (``train.py`` by default) in ``cwd``, its output in the files
        ``stdout`` and ``stderr``; its pid."""
        request = {
            "program": program,
            "args": args,
            "cwd": str(cwd),
            "stdout": str(stdout),
            "stderr": str(stderr),
            "fresh_workers": fresh_workers,
        }
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
            if self._next_message(timeout=deadline - time.monotonic()) is None:
                return None

    def close(self) -> None:
        self.process.stdin.close()  # the server's loop ends at the end of its input
        self.process.wait(timeout=60)
        self.process.stdout.close()

    def _next_message(self, timeout: float) -> dict | None:
        """The server's next answer (an ``exited`` one also noted in ``exit_codes``); None after ``timeout`` s (at
        most 0: None unless an answer is there already)."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.process.stdout], [], [], left)[0]:
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
    child = serve()
    if child is not None:
        kind, request = child
        (become_requested if kind == "requested" else become_proxied)(request)
        run_program(request["program"], request["args"])
