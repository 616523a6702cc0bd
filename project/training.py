"""One training job in one process: build data, model, loggers, callbacks and Trainer from the config, then fit.

Every process of a job runs this: the single process of a one-device run, each worker the launcher starts, or
each rank that torchrun starts.
"""

import logging
import warnings
from pathlib import Path

import lightning as L
import torch
import wandb
from hydra.utils import instantiate
from lightning.pytorch.loggers import Logger, WandbLogger
from lightning.pytorch.trainer.states import TrainerStatus
from omegaconf import DictConfig, OmegaConf

from project.callbacks import JobResult
from project.checkpoints import AtomicCheckpointIO
from project.results import RESULT_FILE
from project.checks import build_strategy, resolve_ckpt_path

# Lightning 2.6 calls a torch pytree API that torch 2.13 deprecated; the warning is theirs and says nothing to users.
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")


def build_net(cfg: DictConfig) -> torch.nn.Module:
    """The plain model on the meta device: shapes only, no memory. Each rank materialises only what it keeps,
    once the strategy has sharded or split it (``TrainingModule.configure_model``)."""
    with torch.device("meta"):
        return instantiate(cfg.model.net)


def build_loggers(cfg: DictConfig) -> list[Logger]:
    """Instantiate each configured logger; W&B also receives the resolved config (group choices included)."""
    run_config = OmegaConf.to_container(cfg, resolve=True)
    loggers = []
    for logger_cfg in (cfg.logger or {}).values():
        logger = instantiate(logger_cfg, _partial_=True)  # partial: `config` is also instantiate's own argument name
        is_wandb = issubclass(logger.func, WandbLogger)
        loggers.append(logger(config=run_config) if is_wandb else logger())
    return loggers


def note_sigterm_without_a_collective(trainer: L.Trainer) -> None:
    """Lightning's SIGTERM handler broadcasts from rank 0 inside the signal handler: a collective started wherever
    the signal lands, which pairs with whatever collective the other ranks are in at that moment (a checkpoint's
    metric reduction, a barrier) and can hang them all until the launcher's timeout, the epoch's checkpoint unsaved.
    Every rank here receives the signal itself (the launcher, torchrun and SLURM signal each process), so the handler
    only notes it; Lightning's loop agrees on it across ranks at the next batch (its own broadcast there)."""
    connector = trainer._signal_connector
    log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")  # where Lightning says it

    def note(signum: int, frame) -> None:
        log.info(f"[rank: {trainer.local_rank}] Received SIGTERM: {signum}")
        if not connector.received_sigterm and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signum)  # processes Lightning itself started, as Lightning does
        connector.received_sigterm = True

    connector._sigterm_notifier_fn = note  # read when fit registers the handlers


def result_file(cfg: DictConfig) -> Path:
    return Path(cfg.paths.output_dir) / RESULT_FILE


def train(cfg: DictConfig) -> None:
    """Fit the configured model; rank 0 writes the job's ``result.json`` (``project.callbacks.JobResult``)."""
    L.seed_everything(cfg.seed, workers=True)
    datamodule = instantiate(cfg.data)
    module = instantiate(cfg.model, net=build_net(cfg))
    loggers = build_loggers(cfg)
    callbacks = [instantiate(callback) for callback in (cfg.callbacks or {}).values()]
    # Whatever the callbacks group holds: sweeps read the result.
    callbacks.append(JobResult(result_file(cfg), cfg.optimized_metric.name, cfg.optimized_metric.mode))
    trainer = instantiate(
        cfg.trainer,
        strategy=build_strategy(cfg.strategy),
        callbacks=callbacks,
        logger=loggers or False,
        plugins=[AtomicCheckpointIO()],  # a checkpoint that cannot be written stops the run (Lightning's goes on)
    )
    note_sigterm_without_a_collective(trainer)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=resolve_ckpt_path(cfg))
    finally:
        # Close the W&B run in this process, also on failure, so none is left half-open and the next job of
        # an in-process sweep starts a new one.
        if wandb.run is not None:
            wandb.finish(exit_code=0 if trainer.state.status == TrainerStatus.FINISHED else 1)
