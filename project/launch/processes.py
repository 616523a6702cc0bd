"""Worker processes that cannot outlive their launcher, and that show when they stop responding. Standard library
only: workers call it first thing."""

import ctypes
import faulthandler
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

LAUNCHER_PID_VARIABLE = "PROJECT_LAUNCHER_PID"  # set by the launcher for its workers
_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process the moment its parent dies (Linux; elsewhere nothing changes).

    torchelastic starts every worker in a session of its own, so a launcher killed with SIGKILL (whose own
    handlers never run) would leave its workers training, writing into a job dir the user is resuming into,
    or waiting for minutes on a rendezvous that will never complete. Where the launcher gave its pid, a
    parent that died before this call took effect is caught too.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    launcher = os.environ.get(LAUNCHER_PID_VARIABLE)
    if launcher is not None and os.getppid() != int(launcher):
        os._exit(1)  # the launcher is already gone


def stop_on_early_warning() -> None:
    """SLURM's early-warning signal (``sbatch --signal=USR1@90``, sent ahead of a preemption or the time limit)
    stops this process as SIGTERM does: Lightning ends training cleanly, and a requeued job with ``ckpt_path=auto``
    resumes from ``last.ckpt``. A launcher that receives it stops its workers with it (torchelastic handles it)."""
    signal.signal(signal.SIGUSR1, lambda signum, frame: os.kill(os.getpid(), signal.SIGTERM))


def interrupt_once() -> None:
    """Ctrl-C interrupts this worker once (KeyboardInterrupt: Lightning stops the run cleanly), and later ones are
    ignored: a terminal sends SIGINT to the launcher and the workers, and torchelastic passes it on to the workers
    again, which would interrupt their stopping (a traceback from whatever teardown it lands in). The handler keeps
    its own flag rather than setting SIG_IGN: Lightning's teardown puts back the handlers it found at setup, this
    one among them, and a signal passed on late would then land in that teardown."""
    interrupted = False

    def interrupt(signum: int, frame: object) -> None:
        nonlocal interrupted
        if not interrupted:
            interrupted = True
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt)


JOB_LOG_VARIABLE = "PROJECT_JOB_LOG"  # set by the launcher: the job's log file, which workers append to
HEARTBEAT_DIR_VARIABLE = "PROJECT_HEARTBEAT_DIR"  # set by the launcher: where each worker's heartbeat file goes
HEARTBEAT_INTERVAL_S = 1.0


# The signal that makes a worker write every thread's Python stack (faulthandler) to its stack file and go on, as
# the JVM's thread dump: the launcher's hang watchdog sends it, and so can a user (kill -QUIT <worker pid>).
STACK_DUMP_SIGNAL = signal.SIGQUIT


def heartbeat_file(heartbeat_dir: str | Path, rank: int) -> Path:
    """Rank ``rank``'s heartbeat: the file holds the worker's pid, its modification time the last beat."""
    return Path(heartbeat_dir) / f"rank{rank}"


def stack_file(heartbeat_dir: str | Path, rank: int) -> Path:
    return Path(heartbeat_dir) / f"rank{rank}.stack"


_stack_dump_target = None  # the open stack file; faulthandler writes to its descriptor, so it must stay open


def start_heartbeat(rank: int) -> None:
    """Touch this rank's heartbeat file every second from a daemon thread, and dump the Python stacks on
    ``STACK_DUMP_SIGNAL``, where the launcher asked for it.

    A stopped process, or one stuck in code that holds the interpreter, stops beating: the launcher's watchdog
    (``project.launch.watchdog``) then has every rank dump its stacks and fails the job, and the launcher's report
    names the rank. A rank waiting in a collective for a stuck peer goes on beating.
    """
    global _stack_dump_target
    heartbeat_dir = os.environ.get(HEARTBEAT_DIR_VARIABLE)
    if heartbeat_dir is None:
        return
    path = heartbeat_file(heartbeat_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(os.getpid()))
    _stack_dump_target = stack_file(heartbeat_dir, rank).open("w")
    faulthandler.register(STACK_DUMP_SIGNAL, file=_stack_dump_target, all_threads=True, chain=False)

    def beat() -> None:
        while True:
            path.touch()
            time.sleep(HEARTBEAT_INTERVAL_S)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def launched_by_torchrun() -> bool:
    """torchrun (or any torchelastic agent) already started this process as one rank of the job."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def torchrun_rank() -> int:
    """This process's rank under torchrun, else 0: a ``RANK`` left in the environment of a plain ``python
    train.py`` (from a shell that ran a distributed job) does not make it a worker of another job."""
    return int(os.environ.get("RANK", "0")) if launched_by_torchrun() else 0


@dataclass(frozen=True)
class NodeTask:
    """This process's node in its job: hydra-submitit-launcher (``launcher=slurm``) runs the Hydra job once per
    node, one task per node, and each task starts its node's ranks; anywhere else the job has one node."""

    rank: int = 0  # this node's rank: its task's
    count: int = 1  # nodes in the job: its tasks
    head: str = "localhost"  # host of node 0, where the ranks meet
    job_id: str = ""  # the cluster's job id (submitit's local executor: its controller's pid)


def node_task() -> NodeTask:
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return NodeTask()
    import submitit

    env = submitit.JobEnvironment()
    return NodeTask(env.global_rank, env.num_tasks, env.hostnames[0], env.raw_job_id)


def is_rank_zero() -> bool:
    """This process is rank 0 of its job: always, unless torchrun started several ranks or a cluster launcher
    several node tasks."""
    return torchrun_rank() == 0 and node_task().rank == 0
