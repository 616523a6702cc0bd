"""What people at a terminal see: the composed config as a tree, Lightning's log lines once each, and where a
finished job's results went."""

import logging
import re
import shutil
import sys
from pathlib import Path
from typing import Any, cast

import rich
import rich.syntax
import rich.tree
from omegaconf import DictConfig, OmegaConf

from project.job.job import Job
from project.options.log_records import LOG_FILE_ONLY_KEY

# Groups first in this order, then any other top-level keys.
FIRST = ("choices", "overrides", "model", "data", "strategy", "trainer", "logger", "callbacks", "paths")


def print_job_summary(job: Job, cfg: DictConfig) -> None:
    """What a job trains, in three lines (``print_config=true``; ``full`` prints the whole config instead); ``cfg``:
    its config, resolved."""
    parameters = sum(parameter.numel() for parameter in job.meta_net().parameters())
    dims = job.dims
    split = [
        f"{name} {size}"
        for name, size in (
            ("pipeline", dims.pipeline),
            ("tensor parallel", dims.tensor_parallel),
            ("expert parallel", dims.expert_parallel),
        )
        if size > 1
    ]
    layout = ", ".join([f"data parallel {dims.data_parallel}", *split])
    evaluating = cfg.get("mode") == "eval"
    weights = job.ckpt_path or OmegaConf.select(cfg, "model.init_from")  # mode=eval's: a checkpoint or a HF dir
    work = f"one pass over the validation set with {weights}" if evaluating else f"{cfg.trainer.max_epochs} epoch(s)"
    print(
        f"{'Evaluation' if evaluating else 'Job'}: model={job.model.name} ({parameters:,} parameters), "
        f"strategy={job.strategy_name} ({layout}) on {job.devices} device(s) x {job.nodes} node(s), precision "
        f"{job.precision}\n"
        f"  data={cfg.choices.get('data')}: {job.batch_size} per replica, a global batch of {job.global_batch}, "
        f"{work}\n"
        f"  the whole config: {cfg.paths.output_dir}/config.yaml, or print_config=full",
        flush=True,
    )


def print_config_tree(cfg: DictConfig) -> None:
    """Print each top-level section of the (resolved) config as a branch of YAML."""
    tree = rich.tree.Tree("CONFIG", style="bold", guide_style="dim")
    keys = [key for key in FIRST if key in cfg] + cast(list[str], [key for key in cfg if key not in FIRST])  # str keys
    for key in keys:
        value = cfg[key]
        text = OmegaConf.to_yaml(value) if isinstance(value, DictConfig) else str(value)
        tree.add(f"[bold]{key}[/]").add(rich.syntax.Syntax(text, "yaml", theme="ansi_dark", background_color="default"))
    rich.print(tree)


# Lightning's start-up lines that say nothing about this job: which accelerators it did not find, an advert, the
# summary callback it keeps, each rank's joining the group and, but rank 0's, its seed (the same on every rank).
# The job's log file has them; the console does not.
LIGHTNING_BOILERPLATE = re.compile(
    r"(GPU available:|TPU available:|💡 Tip:|Trainer already configured with model summary|Initializing distributed:"
    r"|\[rank: [1-9]\d*\] Seed set to)"
)


class LogFileOnly(logging.Filter):
    """On a console handler: drops the records marked ``LOG_FILE_ONLY`` (``project.options.log_records``) and
    Lightning's ``LIGHTNING_BOILERPLATE``, which other handlers (the job's log file) keep."""

    def filter(self, record: logging.LogRecord) -> bool:
        boilerplate = record.name.startswith("lightning") and LIGHTNING_BOILERPLATE.match(record.getMessage())
        return not (boilerplate or getattr(record, LOG_FILE_ONLY_KEY, False))


def lightning_logs_through_root() -> None:
    """``import lightning`` gives its loggers console handlers of their own ("lightning.pytorch" and
    "lightning.fabric" stop propagating); drop them, so that Lightning's records reach the root logger's handlers
    (the console and the job's log file) once, its boilerplate the log file only."""
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    for handler in logging.getLogger().handlers:
        is_console = isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
        if is_console and not any(isinstance(existing, LogFileOnly) for existing in handler.filters):
            handler.addFilter(LogFileOnly())


def program(name: str) -> str:
    """``name`` (``python``, ``wandb``, ``optuna-dashboard``) as a user types it in their shell to get this
    environment's: the bare name where the shell finds this one, else its path in this interpreter's bin dir (a
    ``.venv`` that ``make`` made but nobody activated), relative to the current dir when under it."""
    own = Path(sys.executable).parent / name
    found = shutil.which(name)
    if not own.exists() or (found is not None and Path(found).absolute() == own.absolute()):
        return name
    try:
        return str(own.relative_to(Path.cwd()))
    except ValueError:
        return str(own)


def print_outputs(job_dir: Path, result: dict[str, Any] | None) -> None:
    """Where the job's results went: its dir and the files in it that matter, with the objective."""
    lines = [f"Results in {job_dir}:"]
    if result and result.get("objective") is not None:
        lines.append(
            f"  result.json    {result['metric']} ({result['mode']}) {result['objective']:.6g} at epoch "
            f"{result['best_epoch']}, {result['epochs']} epochs, {result['status']}"
        )
    checkpoints = sorted(path.name for path in (job_dir / "checkpoints").glob("*.ckpt"))
    if checkpoints:
        lines.append(f"  checkpoints/   {', '.join(checkpoints)}")
    lines.append("  train.log      the job's log, every rank's records")
    for run_dir in sorted((job_dir / "wandb").glob("*run-*"))[-1:]:
        if run_dir.name.startswith("offline-"):
            wandb = program("wandb")
            lines.append(f"  W&B (offline)  {run_dir.relative_to(job_dir)}: see it with {wandb} leet {run_dir.parent}")
            lines.append(f"                 upload it with {wandb} sync {run_dir}")
        else:
            lines.append(f"  W&B            {run_dir.relative_to(job_dir)}")
    for metrics in sorted((job_dir / "csv").glob("version_*/metrics.csv"))[-1:]:
        lines.append(f"  CSV            {metrics}")
    lines.append(f"  report         {program('python')} -m project.cli.report {job_dir}")
    print("\n".join(lines), flush=True)
