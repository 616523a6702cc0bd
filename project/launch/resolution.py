"""One step from the composed Hydra config to a launch (``resolve_launch``), which every later stage reads instead of
checking or resolving again: the config resolved (the checkpoint to load, the W&B run), its checked, typed ``Job``,
the memory plan, and how the job launches.

Each check and resolution runs once per launch (``tests/test_config.py`` counts them). ``plan=true`` stops after
the plan (``print_memory_plan``).
"""

import logging
import os
import re
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import cast

import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import get_class
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from project.checkpointing.files import consolidate_checkpoint, is_sharded_checkpoint
from project.checkpointing.hf import FAMILY_KEYS, family_of, net_options, read_config
from project.config.checks import check_config, check_fresh_start, check_not_adapters
from project.job.job import Job
from project.launch.processes import NodeTask, is_rank_zero, node_task
from project.launch.trial import job_trial
from project.options.errors import ConfigError
from project.plan.memory_plan import MemoryPlan, check_fits, format_plan, plan_memory
from project.plan.search import format_search, search, suggest_fastest
from project.plan.step_time import format_step, predict_step

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launch:
    """A launch: its config (resolved: ``ckpt_path`` the file or dir its strategy loads, or None; the W&B run's name
    and id set), what the workers load; its checked, typed ``job``; the memory plan it was launched with (None under
    torchrun and for evaluations); and how it launches."""

    cfg: DictConfig
    job: Job
    plan: MemoryPlan | None
    torchrun: bool
    node: NodeTask

    @property
    def in_process(self) -> bool:
        """Whether this process trains itself (one device, or a rank torchrun started) rather than start a
        worker per device."""
        return self.torchrun or (self.job.processes_per_node == 1 and self.node.count == 1)

    @property
    def config_file(self) -> Path:
        """The resolved config this job trains with: the job's record, and what launched workers load. Other nodes
        keep a copy of their own (the same but for the W&B id, which only rank 0, on node 0, uses)."""
        return (
            Path(self.cfg.paths.output_dir) / "config.yaml" if self.node.rank == 0 else self.workers_dir / "config.yaml"
        )

    @property
    def workers_dir(self) -> Path:
        job_dir = Path(self.cfg.paths.output_dir)
        return job_dir / "workers" if self.node.rank == 0 else job_dir / "workers" / f"node{self.node.rank}"


def resolve_launch(cfg: DictConfig, torchrun: bool) -> Launch:
    """The composed config resolved, checked (``ConfigError`` for the first setting that cannot work, before any
    worker or W&B run starts) and planned, once."""
    cfg = resolved_config(cfg)
    job = check_config(cfg)
    check_fresh_start(cfg)
    node = node_task()
    check_launch(job, torchrun, node)
    warn_if_resumed_differently(job, cfg)
    name_wandb_run(job, cfg)
    job = replace(job, ckpt_path=checkpoint_to_load(job, cfg))
    cfg.ckpt_path = job.ckpt_path  # what the workers load
    return Launch(cfg, job, planned_memory(job, cfg, torchrun), torchrun, node)


def print_memory_plan(cfg: DictConfig) -> None:
    """``plan=true``: the config checked and its memory plan printed, with activation checkpointing both ways and,
    if it does not fit, the smallest change that does, and with a ``cluster`` its predicted step time.
    ``plan=search``: every layout of the job's devices ranked by predicted step time. Nothing is trained."""
    cfg = resolved_config(cfg)
    job = check_config(cfg)
    if cfg.plan == "search":
        print(format_search(job, search(job)))
        return
    plan = plan_memory(job, suggest=job.cluster is None, alternatives=True, progress=True)
    suggest_fastest(plan, job)
    print(format_plan(plan, job))
    if job.cluster is not None:
        print(format_step(predict_step(plan, job, job.cluster), job.cluster, job))


def resolved_config(cfg: DictConfig) -> DictConfig:
    """The resolved config of this Hydra job, plus what only the Hydra process knows.

    Adds ``choices`` (the option picked in each config group, e.g. ``strategy: ddp``), ``overrides`` (the
    job's command-line overrides, a sweep's values included) and, in an Optuna search, ``trial`` (study, number,
    params: ``project.launch.trial``), and sets the W&B run's ``job_type`` (``train``, or ``sweep`` for a multirun
    job) and, in a multirun, its group: the study's name in a search, else the sweep dir's name, so the runs appear
    together (and W&B's parallel-coordinates chart finds each trial's number and params in its config).
    """
    check_not_adapters(cfg)
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.choices = {
            group: option for group, option in hydra_cfg.runtime.choices.items() if not group.startswith("hydra")
        }
        cfg.overrides = list(hydra_cfg.overrides.task)
        trial = job_trial(cast(DictConfig, hydra_cfg))
        if trial is not None:
            cfg.trial = trial
        wandb_cfg = OmegaConf.select(cfg, "logger.wandb")
        if wandb_cfg is not None and wandb_cfg.job_type is None:
            wandb_cfg.job_type = "sweep" if multirun else "train"
        if wandb_cfg is not None and wandb_cfg.group is None and multirun:
            wandb_cfg.group = trial["study"] if trial else Path(hydra_cfg.sweep.dir).name
    try:
        resolved = cast(DictConfig, OmegaConf.create(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)))
    except MissingMandatoryValue as error:  # a ??? the command line did not fill (model=language_model: no net)
        raise ConfigError(
            str(error.full_key),
            "is required and has no value (???).",
            f"set it on the command line: {error.full_key}=..., or choose an option that sets it.",
        ) from None
    except InterpolationResolutionError as error:
        message = cast(str, error.msg)  # set when omegaconf raises it (format_and_raise)
        raised = re.search(r"ConfigError raised while resolving interpolation: (\S+): (.*?) Fix: (.*?)\n", message)
        if raised:  # a resolver's own error (data=shards: no meta.json in data.path)
            raise ConfigError(*raised.groups()) from None
        missing = re.search(r"Missing mandatory value: (\S+)", message)
        if missing:
            raise ConfigError(
                missing.group(1),
                "is required and has no value (???).",
                f"set it on the command line: {missing.group(1)}=...",
            ) from None
        raise ConfigError(
            str(error.full_key),
            f"cannot be resolved: {error.msg}",
            "choose options that fit together (model=gpt with data=tokens or data=text; model=mlp with "
            "data=synthetic), or set the key explicitly.",
        ) from None
    shape_from_init_dir(resolved)
    return resolved


def shape_from_init_dir(cfg: DictConfig) -> None:
    """``model.init_from``: ``model.net``'s shape and numeric options (widths, heads, vocabulary, RoPE, norm eps,
    tying) read from the Hugging Face dir's ``config.json``, as ``from_pretrained`` reads them, but for those the
    command line sets, which the checks hold to the dir (``check_matches``: a conflict names the key), and the
    family's own (``FAMILY_KEYS``: a dir of another family is refused). The context length stays the data's: a
    model may train on a shorter context than it was made for."""
    path = OmegaConf.select(cfg, "model.init_from")
    if path is None or not (Path(path) / "config.json").is_file():
        return  # nothing to read: the checks say what is wrong with the dir
    config = read_config(path)
    if not issubclass(get_class(cfg.model.net._target_), family_of(config).net_class):
        return  # another family: the checks name it
    explicit = {override.split("=", 1)[0].lstrip("+~") for override in cfg.overrides}
    with open_dict(cfg):
        for key, value in net_options(config).items():
            set_here = any(k == f"model.net.{key}" or k.startswith(f"model.net.{key}.") for k in explicit)
            if key not in ("max_length", *FAMILY_KEYS) and not set_here:
                cfg.model.net[key] = value


def check_launch(job: Job, torchrun: bool, node: NodeTask) -> None:
    """Process counts this launcher can honour: torchrun's world size must match the job's, and several nodes need
    a launcher on each (torchrun, or the node tasks of ``launcher=slurm``)."""
    if torchrun and int(os.environ["WORLD_SIZE"]) != job.world_size:
        raise ConfigError(
            "trainer.devices",
            f"asks for {job.processes_per_node} processes per node x {job.nodes} nodes, but "
            f"torchrun started {os.environ['WORLD_SIZE']} in all.",
            "give both the same counts: torchrun --nnodes N --nproc-per-node D train.py trainer.num_nodes=N "
            "trainer.devices=D.",
        )
    if node.job_id and node.count != job.nodes:
        raise ConfigError(
            "trainer.num_nodes",
            f"is {job.nodes}, but the cluster launcher started this job on {node.count} nodes: it sizes "
            "every job of a sweep from the command line's values.",
            "run each value of trainer.num_nodes (and of trainer.devices) as a sweep of its own.",
        )
    if not torchrun and not node.job_id and job.nodes > 1:
        raise ConfigError(
            "trainer.num_nodes",
            "is more than 1, which needs a launcher on every machine.",
            "use launcher=slurm (one task per node starts its ranks), or start train.py on each machine with "
            "torchrun (on SLURM: srun ... torchrun), as docs/launching.md shows.",
        )


# The settings whose change makes a resumed run's numbers differ from the uninterrupted run's.
LAYOUT_KEYS = ("choices.strategy", "trainer.devices", "trainer.num_nodes", "data.batch_size")


def warn_if_resumed_differently(job: Job, cfg: DictConfig) -> None:
    """A job resuming its own dir with another strategy, device count or batch size than the earlier attempt's
    (its ``config.yaml``) trains on, but no longer gives the uninterrupted run's numbers: said, naming the keys."""
    previous_config = Path(cfg.paths.output_dir) / "config.yaml"
    if cfg.ckpt_path not in ("last", "auto") or job.ckpt_path is None or not previous_config.is_file():
        return
    previous = OmegaConf.load(previous_config)
    changed = [
        f"{key.removeprefix('choices.')}={OmegaConf.select(cfg, key)} (was {OmegaConf.select(previous, key)})"
        for key in LAYOUT_KEYS
        if OmegaConf.select(cfg, key) != OmegaConf.select(previous, key)
    ]
    if changed:
        log.warning(
            f"Resuming {cfg.paths.output_dir} with {', '.join(changed)}: training goes on, but the global batch "
            "or its split differs from the earlier attempt's, so the numbers will not be the uninterrupted run's. "
            "Its own settings are in .hydra/attempts/ (resume with its overrides to keep them)."
        )


def name_wandb_run(job: Job, cfg: DictConfig) -> None:
    """A job resuming its own dir (``ckpt_path=last`` or ``auto`` with a checkpoint there) continues its W&B run:
    the id is the one the previous attempt recorded in the job dir's ``config.yaml``; any other job gets a new one.
    So a preempted and requeued job is one W&B run with every epoch once. A run without a name is named after the
    model, the strategy and its layout (``ParallelDims.run_name_tag``), the devices and the nodes."""
    wandb_cfg = OmegaConf.select(cfg, "logger.wandb")
    if wandb_cfg is None:
        return
    if wandb_cfg.get("name") is None:
        with open_dict(wandb_cfg):
            wandb_cfg.name = (
                f"{job.model.name}-{job.strategy_name}{job.dims.run_name_tag()}-{job.devices}dev-{job.nodes}node"
            )
    if wandb_cfg.get("id") is not None:
        return
    previous_config = Path(cfg.paths.output_dir) / "config.yaml"
    previous_id = None
    if cfg.ckpt_path in ("last", "auto") and job.ckpt_path is not None and previous_config.is_file():
        previous_id = OmegaConf.select(OmegaConf.load(previous_config), "logger.wandb.id")
    with open_dict(wandb_cfg):
        wandb_cfg.id = previous_id or uuid.uuid4().hex[:12]  # what W&B would pick: a short random id


def checkpoint_to_load(job: Job, cfg: DictConfig) -> str | None:
    """The job's checkpoint (resolved) as a path its strategy can load: a sharded checkpoint is consolidated into
    ``<job dir>/consolidated.ckpt`` (by one process) for strategies that load single files."""
    path = job.ckpt_path
    if path is None or not is_sharded_checkpoint(path) or job.layout.saves_sharded_checkpoints:
        return path
    target = Path(cfg.paths.output_dir) / "consolidated.ckpt"
    if is_rank_zero():
        module = job.model.new_module(job.meta_net())  # on the meta device: only its parameter names count
        consolidate_checkpoint(path, target, module.parameter_groups())
    if dist.is_initialized():
        dist.barrier()  # torchrun: the other ranks wait for rank 0's file
    return str(target)


def planned_memory(job: Job, cfg: DictConfig, torchrun: bool) -> MemoryPlan | None:
    """The job's memory plan, computed before any worker starts; a run predicted not to fit is refused here
    (``memory_plan.if_over``). Under torchrun the ranks already hold a process group, which the plan's
    simulation needs to itself: ``plan=true`` on a machine without torchrun checks such a job beforehand. An
    evaluation (``mode=eval``) trains no step, which is what a plan simulates."""
    if torchrun or cfg.mode == "eval":
        return None
    plan = plan_memory(job, suggest=job.cluster is None)
    suggest_fastest(plan, job)
    if is_rank_zero():
        log.info(format_plan(plan, job))
    check_fits(plan, job)
    return plan
