"""One training job in one process: build data, model, loggers, callbacks and Trainer from the config, then fit.

Every process of a job runs this: the single process of a one-device run, each worker the launcher starts, or
each rank that torchrun starts.
"""

import signal
import sys
import warnings
from pathlib import Path

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.trainer.states import TrainerStatus
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig, OmegaConf

from project.checkpointing.files import AtomicCheckpointIO
from project.config.build import build_net, build_strategy, configured_callbacks
from project.launch.job_result import JobResult
from project.launch.lean_loop import lighten
from project.launch.results import RESULT_FILE
from project.launch.stop_together import StopTogether
from project.launch.trial import PruneTrial
from project.options.errors import JobStopped

# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecated; the warning is theirs and says nothing to users.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def build_loggers(cfg: DictConfig) -> list[Logger]:
    """Instantiate each configured logger; W&B also receives the resolved config (group choices included)."""
    run_config = OmegaConf.to_container(cfg, resolve=True)
    loggers = []
    for logger_cfg in (cfg.logger or {}).values():
        logger = instantiate(logger_cfg, _partial_=True)  # partial: `config` is also instantiate's own argument name
        is_wandb = issubclass(logger.func, WandbLogger)
        loggers.append(logger(config=run_config) if is_wandb else logger())
    return loggers


def result_file(cfg: DictConfig) -> Path:
    return Path(cfg.paths.output_dir) / RESULT_FILE


def set_tf32(enabled: bool, device: torch.device) -> None:
    """float32 matmuls in TF32 on a GPU's tensor cores (Ampere and newer; about 8x the float32 rate, with a 10-bit
    mantissa, as in bf16-mixed's matmuls) or in full float32. CPU runs are left as they are."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if enabled else "highest")


def train(cfg: DictConfig) -> None:
    """Fit the configured model (or, with ``mode=eval``, validate it); rank 0 writes the job's ``result.json``
    (``project.launch.job_result.JobResult``)."""
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.model, net=build_net(cfg))
    loggers = build_loggers(cfg)
    evaluating = cfg.get("mode") == "eval"
    callbacks = [instantiate(callback) for callback in configured_callbacks(cfg).values()]
    if evaluating:  # the training job's checkpoint callback state, restored into this job dir, is not needed
        warnings.filterwarnings("ignore", message=r"The dirpath has changed from")
    if cfg.get("ckpt_path") is not None:  # a resumed run's own checkpoints are there: expected, not a warning
        warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    # A trial of an Optuna search with a pruner reports to its study after each validation, and may stop early.
    trial = cfg.get("trial")
    pruning = PruneTrial(trial, cfg.optimized_metric.name) if trial is not None and trial.pruner else None
    # Whatever the callbacks group holds: sweeps read the result.
    callbacks.append(
        JobResult(
            result_file(cfg),
            cfg.optimized_metric.name,
            cfg.optimized_metric.mode,
            pruning,
            cfg.optimized_metric.get("also") or (),
        )
    )
    if pruning is not None:
        callbacks.append(pruning)
    # Whatever the callbacks group holds: a preempted job must stop cleanly, a diverged one fail on every rank.
    callbacks.append(StopTogether(cfg.get("step_checks", "auto")))
    trainer = instantiate(
        cfg.trainer,
        strategy=build_strategy(cfg.strategy),
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[AtomicCheckpointIO()],  # a checkpoint that cannot be written stops the run (Lightning's goes on)
    )
    set_tf32(cfg.tf32, trainer.strategy.root_device)
    lighten(trainer)
    try:
        if evaluating:  # Lightning prints the metrics' table; the loggers and result.json get them
            trainer.validate(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        else:
            trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
    except SystemExit as stop:
        # Lightning ends a run stopped by SIGTERM with SIGTERMException and one stopped by Ctrl-C with sys.exit(1):
        # both SystemExit, so without this a preempted run would exit 0 as if it had finished.
        if trainer.state.status != TrainerStatus.INTERRUPTED:
            raise
        signum = signal.SIGTERM if isinstance(stop, SIGTERMException) else signal.SIGINT
        raise JobStopped(
            f"Stopped by {signal.Signals(signum).name} in epoch {trainer.current_epoch}, after "
            f"{trainer.global_step} optimizer steps.",
            signum,
        ) from None
    finally:
        # Close the W&B run in this process, also on failure, so none is left half-open and the next job of
        # an in-process sweep starts a new one.
        wandb = sys.modules.get("wandb")  # imported only by a W&B logger
        if wandb is not None and wandb.run is not None:
            wandb.finish(exit_code=0 if trainer.state.status == TrainerStatus.FINISHED else 1)
