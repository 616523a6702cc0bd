"""From a composed Hydra config to a running job: check it, then train in this process or start one worker per device.

Why not Lightning's own launcher: for DDP it re-executes ``sys.argv``, so each worker of a Hydra multirun job
would start the whole sweep again. Instead the job's resolved config is written to ``<job dir>/config.yaml`` and
torch's elastic launcher (what ``torchrun`` uses) starts ``python -m project.launch.worker <that file>`` once per device.
The workers see torchelastic's environment, so Lightning joins them into one process group without relaunching.
"""

import atexit
import logging
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import instantiate
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from project.launch.results import read_result
from project.checkpointing.files import consolidate_checkpoint, is_sharded_checkpoint
from project.config.checks import check_config, resolve_ckpt_path, strategy_shards_model, uses_cuda
from project.observability.console import lightning_logs_through_root, print_config_tree, print_outputs
from project.config.errors import ConfigError, JobFailed
from project.launch.failures import failure_report
from project.launch.job_dir import job_dir_lock
from project.memory.plan import MemoryPlan, check_fits, format_plan, plan_memory, write_plan
from project.launch.processes import (
    HEARTBEAT_DIR_VARIABLE,
    JOB_LOG_VARIABLE,
    LAUNCHER_PID_VARIABLE,
    die_with_parent,
    stop_on_early_warning,
)
from project.launch.training import build_net, result_file, train

log = logging.getLogger(__name__)


def launched_by_torchrun() -> bool:
    """torchrun (or any torchelastic agent) already started this process as one rank of the job."""
    return "TORCHELASTIC_RUN_ID" in os.environ


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


def rendezvous_port(job_id: str) -> int:
    """A port every node of a job computes alike from the job id, as Lightning's SLURM environment does, so that
    the nodes meet without talking first."""
    return 15000 + int(job_id) % 10000


def is_rank_zero() -> bool:
    """This process is rank 0 of its job: always, unless torchrun started several ranks or a cluster launcher
    several node tasks."""
    return int(os.environ.get("RANK", "0")) == 0 and node_task().rank == 0


def job_config(cfg: DictConfig) -> DictConfig:
    """The resolved config of this Hydra job, plus what only the Hydra process knows.

    Adds ``choices`` (the option picked in each config group, e.g. ``strategy: ddp``) and ``overrides`` (the
    job's command-line overrides, a sweep's values included), and sets the W&B run's ``job_type`` (``train``, or
    ``sweep`` for a multirun job) and, in a multirun, its group: the sweep dir's name, so the runs appear together.
    """
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.choices = {
            group: option for group, option in hydra_cfg.runtime.choices.items() if not group.startswith("hydra")
        }
        cfg.overrides = list(hydra_cfg.overrides.task)
        wandb_cfg = OmegaConf.select(cfg, "logger.wandb")
        if wandb_cfg is not None and wandb_cfg.job_type is None:
            wandb_cfg.job_type = "sweep" if multirun else "train"
        if wandb_cfg is not None and wandb_cfg.group is None and multirun:
            wandb_cfg.group = Path(hydra_cfg.sweep.dir).name
    try:
        return OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
    except MissingMandatoryValue as error:  # a ??? the command line did not fill (model=language_model: no net)
        raise ConfigError(str(error.full_key), "is required and has no value (???).",
                          f"set it on the command line: {error.full_key}=..., or choose an option that sets it.") from None
    except InterpolationResolutionError as error:
        raised = re.search(r"ConfigError raised while resolving interpolation: (\S+): (.*?) Fix: (.*?)\n", error.msg)
        if raised:  # a resolver's own error (data=shards: no meta.json in data.path)
            raise ConfigError(*raised.groups()) from None
        missing = re.search(r"Missing mandatory value: (\S+)", error.msg)
        if missing:
            raise ConfigError(missing.group(1), "is required and has no value (???).",
                              f"set it on the command line: {missing.group(1)}=...") from None
        raise ConfigError(
            str(error.full_key),
            f"cannot be resolved: {error.msg}",
            "choose options that fit together (model=gpt with data=tokens or data=text; model=mlp with "
            "data=synthetic), or set the key explicitly.",
        ) from None


def concurrent_jobs() -> int:
    """Jobs of this sweep that run at the same time on this machine: Hydra's parallel launchers (joblib) say so in
    ``hydra.launcher.n_jobs`` (-1: one per core); the basic launcher runs one at a time."""
    n_jobs = OmegaConf.select(HydraConfig.get(), "launcher.n_jobs")
    if not isinstance(n_jobs, int) or HydraConfig.get().mode != RunMode.MULTIRUN:
        return 1
    return len(os.sched_getaffinity(0)) if n_jobs < 0 else max(1, n_jobs)


def threads_per_process(processes: int) -> int:
    """The cores this process may use (a SLURM allocation's, or the machine's) split evenly between the processes
    of every job running at once."""
    return max(1, len(os.sched_getaffinity(0)) // (processes * concurrent_jobs()))


@contextmanager
def _worker_environment(num_workers: int, heartbeat_dir: Path) -> Iterator[None]:
    """What the workers inherit besides torchelastic's variables: this process's pid (they die with it), where
    their heartbeats and log records go, and this machine's cores split between CPU workers unless the user set
    OMP_NUM_THREADS (torchrun sets 1)."""
    added = {LAUNCHER_PID_VARIABLE: str(os.getpid()), HEARTBEAT_DIR_VARIABLE: str(heartbeat_dir),
             JOB_LOG_VARIABLE: str(job_log_file())}
    if "OMP_NUM_THREADS" not in os.environ:
        added["OMP_NUM_THREADS"] = str(threads_per_process(num_workers))
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            del os.environ[name]


def job_log_file() -> Path:
    """Hydra's log file of this job (``<job dir>/<job name>.log``: ``train.log``)."""
    hydra_cfg = HydraConfig.get()
    return Path(hydra_cfg.runtime.output_dir) / f"{hydra_cfg.job.name}.log"


def launch_workers(config_file: Path, num_workers: int, log_dir: Path, node: NodeTask) -> None:
    """Start ``num_workers`` processes of ``python -m project.launch.worker config_file`` on this node; wait for all
    (on every node, for a job of several)."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if node.count == 1:  # a free port, as `torchrun --standalone`
        rendezvous = dict(rdzv_backend="c10d", rdzv_endpoint="localhost:0", run_id=str(uuid.uuid4()))
    else:  # node ranks fixed to the tasks' (torchrun --node-rank), so global rank 0 is on node 0 with the job's records
        rendezvous = dict(rdzv_backend="static", rdzv_endpoint=f"{node.head}:{rendezvous_port(node.job_id)}",
                          run_id=node.job_id, rdzv_configs={"rank": node.rank})
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
    try:
        with _worker_environment(num_workers, heartbeat_dir):
            elastic_launch(launch_config, sys.executable)("-m", "project.launch.worker", str(config_file))
    except ChildFailedError as error:
        report = failure_report(error, num_workers, log_dir, heartbeat_dir)
        log.error(report)  # on the console and in the job's log
        raise JobFailed(report) from None
    except SignalException as error:  # SIGTERM or SIGUSR1 (a cluster preempting the job), SIGINT...: torchelastic's
        report = (f"Stopped by {error.sigval.name}: all {num_workers} workers were stopped. checkpoints/last.ckpt holds "
                  "the last finished epoch; run the same command with ckpt_path=auto to resume it.")
        log.warning(report)
        raise JobFailed(report) from None


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


def checkpoint_to_load(cfg: DictConfig) -> str | None:
    """``ckpt_path`` as a path this job's strategy can load: a sharded checkpoint is consolidated into
    ``<job dir>/consolidated.ckpt`` (by one process) for strategies that load single files."""
    path = resolve_ckpt_path(cfg)
    if path is None or not is_sharded_checkpoint(path) or strategy_shards_model(cfg):
        return path
    target = Path(cfg.paths.output_dir) / "consolidated.ckpt"
    if is_rank_zero():
        module = instantiate(cfg.model, net=build_net(cfg))  # on the meta device: only its parameter names count
        consolidate_checkpoint(path, target, module.parameter_groups())
    if dist.is_initialized():
        dist.barrier()  # torchrun: the other ranks wait for rank 0's file
    return str(target)


def check_launch(cfg: DictConfig, torchrun: bool) -> None:
    """Process counts this launcher can honour: torchrun's world size must match the config, and several
    nodes need a launcher on each (torchrun, or the node tasks of ``launcher=slurm``)."""
    expected = cfg.strategy.processes * cfg.trainer.num_nodes
    node = node_task()
    if torchrun and int(os.environ["WORLD_SIZE"]) != expected:
        raise ConfigError(
            "trainer.devices",
            f"asks for {cfg.strategy.processes} processes per node x {cfg.trainer.num_nodes} nodes, but torchrun "
            f"started {os.environ['WORLD_SIZE']} in all.",
            "give both the same counts: torchrun --nnodes N --nproc-per-node D train.py trainer.num_nodes=N "
            "trainer.devices=D.",
        )
    if node.job_id and node.count != cfg.trainer.num_nodes:
        raise ConfigError(
            "trainer.num_nodes",
            f"is {cfg.trainer.num_nodes}, but the cluster launcher started this job on {node.count} nodes: it sizes "
            "every job of a sweep from the command line's values.",
            "run each value of trainer.num_nodes (and of trainer.devices) as a sweep of its own.",
        )
    if not torchrun and not node.job_id and cfg.trainer.num_nodes > 1:
        raise ConfigError(
            "trainer.num_nodes",
            "is more than 1, which needs a launcher on every machine.",
            "use launcher=slurm (one task per node starts its ranks), or start train.py on each machine with "
            "torchrun (on SLURM: srun ... torchrun), as the README shows.",
        )


def continue_wandb_run(cfg: DictConfig) -> None:
    """A job resuming its own dir (``ckpt_path=last`` or ``auto`` with a checkpoint there) continues its W&B run:
    the id is the one the previous attempt recorded in the job dir's ``config.yaml``; any other job gets a new one.
    So a preempted and requeued job is one W&B run with every epoch once."""
    wandb_cfg = OmegaConf.select(cfg, "logger.wandb")
    if wandb_cfg is None or wandb_cfg.get("id") is not None:
        return
    previous_config = Path(cfg.paths.output_dir) / "config.yaml"
    previous_id = None
    if cfg.ckpt_path in ("last", "auto") and resolve_ckpt_path(cfg) is not None and previous_config.is_file():
        previous_id = OmegaConf.select(OmegaConf.load(previous_config), "logger.wandb.id")
    with open_dict(wandb_cfg):
        wandb_cfg.id = previous_id or uuid.uuid4().hex[:12]  # what W&B would pick: a short random id


def checked_job_config(cfg: DictConfig, torchrun: bool) -> DictConfig:
    """The job's resolved config, checked (``ConfigError`` for the first setting that cannot work), with
    ``ckpt_path`` a checkpoint this strategy can load and the W&B run id this job logs to."""
    cfg = job_config(cfg)
    check_config(cfg)
    check_launch(cfg, torchrun)
    continue_wandb_run(cfg)
    cfg.ckpt_path = checkpoint_to_load(cfg)
    return cfg


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


def print_memory_plan(cfg: DictConfig) -> None:
    """``plan=true``: the config checked and its memory plan printed, with activation checkpointing both ways and,
    if it does not fit, the smallest change that does; nothing is trained."""
    cfg = job_config(cfg)
    check_config(cfg)
    print(format_plan(plan_memory(cfg, alternatives=True), cfg))


def planned_memory(cfg: DictConfig, torchrun: bool) -> MemoryPlan | None:
    """The job's memory plan, computed before any worker starts; a run predicted not to fit is refused here
    (``memory_plan.if_over``). Under torchrun the ranks already hold a process group, which the plan's
    simulation needs to itself: ``plan=true`` on a machine without torchrun checks such a job beforehand. An
    evaluation (``mode=eval``) trains no step, which is what a plan simulates."""
    if torchrun or cfg.mode == "eval":
        return None
    plan = plan_memory(cfg)
    if is_rank_zero():
        log.info(format_plan(plan, cfg))
    check_fits(plan, cfg)
    return plan


def run(cfg: DictConfig) -> dict[str, Any] | None:
    """Check the config, then train; returns the job's result (``result.json``) in the process Hydra runs (rank 0
    under torchrun), None in torchrun's other ranks and with ``plan=true``."""
    lightning_logs_through_root()  # Hydra's root handlers print them and write the job's log file
    stop_on_early_warning()
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


def _run_job(cfg: DictConfig, torchrun: bool) -> dict[str, Any] | None:
    cfg = checked_job_config(cfg, torchrun)
    plan = planned_memory(cfg, torchrun)
    node = node_task()
    # The resolved config this job trains with: the job's record, and what launched workers load. Other nodes
    # keep a copy of their own (the same but for the W&B id, which only rank 0, on node 0, uses).
    job_dir = Path(cfg.paths.output_dir)
    workers_dir = job_dir / "workers" if node.rank == 0 else job_dir / "workers" / f"node{node.rank}"
    config_file = job_dir / "config.yaml" if node.rank == 0 else workers_dir / "config.yaml"
    if is_rank_zero() and cfg.print_config:
        print_config_tree(cfg)
    if not torchrun or is_rank_zero():
        config_file.parent.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(cfg, config_file)
        if plan is not None and node.rank == 0:
            write_plan(plan, job_dir)  # DeviceMemory logs it next to what it measures
    if torchrun or (cfg.strategy.processes == 1 and node.count == 1):
        if concurrent_jobs() > 1 and "OMP_NUM_THREADS" not in os.environ:
            torch.set_num_threads(threads_per_process(1))  # this job's share of the cores
        train(cfg)
    else:
        launch_workers(config_file, cfg.strategy.processes, workers_dir, node)
    return read_result(result_file(cfg)) if is_rank_zero() else None
