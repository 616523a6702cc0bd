"""From a composed Hydra config to a running job: resolve it once (``project.launch.resolution``), then train in this
process or start one worker per device.

Why not Lightning's own launcher: for DDP it re-executes ``sys.argv``, so each worker of a Hydra multirun job
would start the whole sweep again. Instead the job's resolved config is written to ``<job dir>/config.yaml`` and
torch's elastic launcher (what ``torchrun`` uses) starts ``python -m project.launch.worker <that file>`` once per
device.
The workers see torchelastic's environment, so Lightning joins them into one process group without relaunching.
"""

import atexit
import logging
import math
import os
import shlex
import shutil
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.rank_zero import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from project.config.build import uses_cuda
from project.config.checks import checkpoints_dir
from project.config.schema import check_train_keys
from project.launch.failures import failure_report
from project.launch.job_dir import job_dir_lock
from project.launch.processes import (
    HEARTBEAT_DIR_VARIABLE,
    JOB_LOG_VARIABLE,
    LAUNCHER_PID_VARIABLE,
    NodeTask,
    die_with_parent,
    is_rank_zero,
    launched_by_torchrun,
    stop_on_early_warning,
)
from project.launch.resolution import print_memory_plan, resolve_launch
from project.launch.results import print_sweep_summary, read_result, record_stop
from project.launch.training import result_file, train
from project.launch.watchdog import HeartbeatWatchdog
from project.observability.console import (
    lightning_logs_through_root,
    print_config_tree,
    print_job_summary,
    print_outputs,
    program,
)
from project.options.errors import ConfigError, JobFailed, JobStopped
from project.options.log_records import quieted
from project.plan.memory_plan import write_plan

log = logging.getLogger(__name__)


def rendezvous_port(job_id: str) -> int:
    """A port every node of a job computes alike from the job id, as Lightning's SLURM environment does, so that
    the nodes meet without talking first."""
    return 15000 + int(job_id) % 10000


def concurrent_jobs() -> int:
    """Jobs of this sweep that run at the same time on this machine: Hydra's parallel launchers (joblib) say so in
    ``hydra.launcher.n_jobs`` (-1: one per core); the basic launcher runs one at a time."""
    hydra_cfg = cast(DictConfig, HydraConfig.get())  # a DictConfig, typed by Hydra as its schema
    n_jobs = OmegaConf.select(hydra_cfg, "launcher.n_jobs")
    if not isinstance(n_jobs, int) or HydraConfig.get().mode != RunMode.MULTIRUN:
        return 1
    return len(os.sched_getaffinity(0)) if n_jobs < 0 else max(1, n_jobs)


def threads_per_process(processes: int) -> int:
    """The cores this process may use (a SLURM allocation's, or the machine's) split evenly between the processes
    of every job running at once, and no more than the cores the machine's other work leaves idle (its load
    average): torch's OpenMP threads wait for each other by spinning, so on a busy machine more threads than idle
    cores spin against the other work (the default run's epoch took 70 s at load 8 on 2 cores with 2 threads,
    3.8 s with 1, against 0.38 s quiet: docs/launching.md)."""
    cores = len(os.sched_getaffinity(0))
    idle = math.ceil(cores - os.getloadavg()[0])  # a core counts as busy once its whole share is
    return max(1, min(cores // (processes * concurrent_jobs()), idle))


def forget_stale_ranks() -> None:
    """A job trained in this process, not started by torchrun, is rank 0 of one: a ``RANK`` (``LOCAL_RANK``,
    ``WORLD_SIZE``) left in the environment by a shell that ran a distributed job is dropped, with a line, and
    Lightning's rank-zero-only parts (its loggers: ``RANK=1`` wrote no ``csv/``), which read it as they were
    imported, are told rank 0."""
    stale = {name: os.environ.pop(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE") if name in os.environ}
    if stale:
        settings = " ".join(f"{name}={value}" for name, value in stale.items())
        log.warning(f"Ignoring {settings} in the environment: this run is no rank of a job torchrun started.")
    rank_zero_only.rank = 0  # type: ignore[attr-defined]


def set_threads(threads: int) -> None:
    """Train with ``threads`` intra-op threads, said in one line where that is fewer than torch would take."""
    if threads < torch.get_num_threads():
        log.info(
            f"Training with {threads} intra-op thread(s) of {torch.get_num_threads()}: this job's share of the cores "
            f"the machine leaves idle (load average {os.getloadavg()[0]:.1f}). OMP_NUM_THREADS=N sets them."
        )
    torch.set_num_threads(threads)


@contextmanager
def _worker_environment(num_workers: int, heartbeat_dir: Path) -> Iterator[None]:
    """What the workers inherit besides torchelastic's variables: this process's pid (they die with it), where
    their heartbeats and log records go, and this machine's cores split between CPU workers unless the user set
    OMP_NUM_THREADS (torchrun sets 1)."""
    added = {
        LAUNCHER_PID_VARIABLE: str(os.getpid()),
        HEARTBEAT_DIR_VARIABLE: str(heartbeat_dir),
        JOB_LOG_VARIABLE: str(job_log_file()),
    }
    if "OMP_NUM_THREADS" not in os.environ:
        added["OMP_NUM_THREADS"] = str(threads_per_process(num_workers))
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            del os.environ[name]


def _death_signal(record: logging.LogRecord) -> bool:
    """False for torchelastic's agent's line on a signal ("Received 2 death signal, shutting down workers")."""
    return "death signal" not in record.getMessage()


@contextmanager
def _quiet_worker_failures() -> Iterator[None]:
    """Without torchelastic's own lines on a failed worker ("failed (exitcode: 1) local_rank: 0 ...", "Sending
    process ... closing signal SIGTERM") or on a signal that stops the job (Ctrl-C's): the launcher's report says the
    same once, per rank, with the cause."""
    agent_log = logging.getLogger("torch.distributed.elastic.agent.server.api")
    agent_log.addFilter(_death_signal)
    try:
        with quieted("torch.distributed.elastic.multiprocessing.api", level=logging.CRITICAL):
            yield
    finally:
        agent_log.removeFilter(_death_signal)


def job_log_file() -> Path:
    """Hydra's log file of this job (``<job dir>/<job name>.log``: ``train.log``)."""
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log"


def launch_workers(
    config_file: Path, num_workers: int, log_dir: Path, node: NodeTask, heartbeat_timeout: float | None
) -> None:
    """Start ``num_workers`` processes of ``python -m project.launch.worker config_file`` on this node; wait for all
    (on every node, for a job of several). A worker silent for ``heartbeat_timeout`` seconds (None: never) fails
    the job (``project.launch.watchdog``)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if node.count == 1:  # a free port, as `torchrun --standalone`
        rendezvous: dict[str, Any] = dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=str(uuid.uuid4()))
    else:  # node ranks fixed to the tasks' (torchrun --node-rank), so global rank 0 is on node 0 with the job's records
        rendezvous = dict(
            rdzv_backend="static",
            rdzv_endpoint=f"{node.head}:{rendezvous_port(node.job_id)}",
            run_id=node.job_id,
            rdzv_configs={"rank": node.rank},
        )
    launch_config = LaunchConfig(
        min_nodes=node.count,
        max_nodes=node.count,
        nproc_per_node=num_workers,
        max_restarts=0,
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
        # torchelastic's default set, plus SLURM's early warning: the workers are stopped as for SIGTERM
        signals_to_handle="SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1",
        **rendezvous,
    )
    heartbeat_dir = log_dir / "heartbeats"
    shutil.rmtree(heartbeat_dir, ignore_errors=True)  # a previous run's would look like ranks that stopped
    job_log = job_log_file()
    watchdog = HeartbeatWatchdog(heartbeat_dir, heartbeat_timeout, job_log)
    try:
        with _worker_environment(num_workers, heartbeat_dir), watchdog, _quiet_worker_failures():
            elastic_launch(launch_config, sys.executable)("-m", "project.launch.worker", str(config_file))
    except ChildFailedError as error:
        report = failure_report(error, num_workers, log_dir, heartbeat_dir, watchdog.silent, job_log)
        log.error(report)  # on the console and in the job's log
        raise JobFailed(report) from None
    except SignalException as error:  # SIGTERM or SIGUSR1 (a cluster preempting the job), SIGINT...: torchelastic's
        raise JobStopped(
            f"Stopped by {error.sigval.name}: all {num_workers} workers were stopped.", error.sigval
        ) from None


def process_group_settings(cfg: DictConfig) -> tuple[str, timedelta]:
    """The backend and timeout the strategy is configured with (Lightning's defaults where it names none)."""
    backend = OmegaConf.select(cfg, "strategy.process_group_backend") or ("nccl" if uses_cuda(cfg) else "gloo")
    timeout = OmegaConf.select(cfg, "strategy.timeout")
    return backend, default_pg_timeout if timeout is None else instantiate(timeout)


def join_torchrun_job(cfg: DictConfig) -> None:
    """Under torchrun: join the job's process group, then point every rank at rank 0's job dir.

    The group is made here, with the strategy's backend and timeout, once this rank's GPU is chosen from
    ``LOCAL_RANK`` (so no rank opens a CUDA context on GPU 0); Lightning then uses it as it is, as does every
    further job of a ``-m`` sweep in this process. Each rank composed its own config; the job dirs differ only if
    the ranks started in different seconds (the dir name is a timestamp), so rank 0's is broadcast, before
    resolving, so that every path interpolating ``paths.output_dir`` follows.
    """
    if not dist.is_initialized():
        die_with_parent()  # with torchrun's agent
        backend, timeout = process_group_settings(cfg)
        if uses_cuda(cfg):
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend, timeout=timeout)
        atexit.register(dist.destroy_process_group)
        if is_rank_zero():
            group = dist.distributed_c10d._get_default_group()
            options = group._get_backend(torch.device("cuda" if backend == "nccl" else "cpu")).options
            log.info(f"Process group: {dist.get_backend()}, timeout {options._timeout}, {dist.get_world_size()} ranks")
    own_dir = HydraConfig.get().runtime.output_dir
    shared = [own_dir]
    dist.broadcast_object_list(shared, src=0)
    if shared[0] != own_dir:
        if Path(own_dir).is_dir() and not any(Path(own_dir).iterdir()):
            Path(own_dir).rmdir()  # the empty dir Hydra made for this rank
        with open_dict(cfg):
            cfg.paths.output_dir = shared[0]


@contextmanager
def exclusive_job_dir(cfg: DictConfig, torchrun: bool) -> Iterator[None]:
    """This job's dir for this job alone while it runs (``project.launch.job_dir``); under torchrun rank 0 holds the
    lock and every rank learns whether it got it."""
    key = "hydra.sweep.dir" if HydraConfig.get().mode == RunMode.MULTIRUN else "hydra.run.dir"
    with ExitStack() as stack:
        refusal: list[ConfigError | None] = [None]
        if is_rank_zero():
            try:
                stack.enter_context(job_dir_lock(cfg.paths.output_dir, key))
            except ConfigError as error:
                refusal = [error]
        if torchrun:
            dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            raise refusal[0]
        yield


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Check the config, then train; returns the job's result (``result.json``) in the process Hydra runs (rank 0
    under torchrun), None in torchrun's other ranks and with ``plan=true``."""
    lightning_logs_through_root()  # Hydra's root handlers print them and write the job's log file
    stop_on_early_warning()
    check_train_keys(cfg)
    if cfg.plan:
        print_memory_plan(cfg)
        return None
    torchrun = launched_by_torchrun()
    if torchrun:
        join_torchrun_job(cfg)
    with exclusive_job_dir(cfg, torchrun):
        result = _run_job(cfg, torchrun)
    if is_rank_zero():
        print_outputs(Path(cfg.paths.output_dir), result)
    return result


def report_stop(cfg: DictConfig, stop: JobStopped) -> NoReturn:
    """A job a signal stopped: its result marked interrupted, the command that resumes it logged (in a sweep, after
    the summary of what ran: the sweep stops too); the process exits 128 + the signal's number."""
    if is_rank_zero():
        job_dir = Path(cfg.paths.output_dir)
        multirun = HydraConfig.get().mode == RunMode.MULTIRUN
        record_stop(job_dir, stop)
        if multirun:
            print_sweep_summary(job_dir.parent)
        checkpoints = checkpoints_dir(cfg)
        log.warning(
            f"{stop} The checkpoints in {checkpoints} hold the last finished epoch (and any mid-epoch save after it). "
            f"Resume {'the sweep' if multirun else 'it'} with:\n  {resume_command(multirun)}"
        )
    sys.exit(128 + stop.signum)


def resume_command(multirun: bool) -> str:
    """This process's command line with its dir named and ``ckpt_path=auto``: it resumes the run (or each job of the
    sweep, an Optuna search continuing its study) where it stopped."""
    job_dir = Path(HydraConfig.get().runtime.output_dir)
    key, directory = ("hydra.sweep.dir", job_dir.parent) if multirun else ("hydra.run.dir", job_dir)
    kept = [arg for arg in sys.argv[1:] if arg.split("=", 1)[0].lstrip("+~") not in (key, "ckpt_path")]
    return shlex.join([program("python"), Path(sys.argv[0]).name, *kept, f"{key}={directory}", "ckpt_path=auto"])


def _run_job(cfg: DictConfig, torchrun: bool) -> dict[str, Any] | None:
    launch = resolve_launch(cfg, torchrun)
    cfg = launch.cfg
    if is_rank_zero() and cfg.print_config == "full":
        print_config_tree(cfg)
    elif is_rank_zero() and cfg.print_config:
        print_job_summary(launch.job, cfg)
    if not torchrun or is_rank_zero():
        launch.config_file.parent.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, launch.config_file)
        if launch.plan is not None and launch.node.rank == 0:
            write_plan(launch.plan, Path(cfg.paths.output_dir))  # DeviceMemory logs it next to what it measures
    if launch.in_process:
        if "OMP_NUM_THREADS" not in os.environ:
            set_threads(threads_per_process(1))  # this job's share of the idle cores
        if not torchrun:
            forget_stale_ranks()
        train(cfg)
    else:
        heartbeat_timeout = cfg.strategy.get("heartbeat_timeout")
        launch_workers(
            launch.config_file, launch.job.processes_per_node, launch.workers_dir, launch.node, heartbeat_timeout
        )
    return read_result(result_file(cfg)) if is_rank_zero() else None
