"""The Optuna trial a job is, when ``hparams_search`` runs it: which trial (W&B's group and config name it), and
pruning, where rank 0 reports the optimized metric after each validation and every rank stops when Optuna says so.

optuna is imported only in jobs of a search (it is the ``optuna`` extra, not a training dependency).
"""

import logging
from pathlib import Path
from typing import Any, cast

import lightning as L
import torch
import torch.distributed as dist
from hydra.types import RunMode
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig, OmegaConf

SWEEPER = "hydra_plugins.project_sweeper.optuna_sweeper.OptunaSweeper"

log = logging.getLogger(__name__)


def open_storage(storage: str) -> Any:
    """The study storage ``storage`` names: an RDB URL (``sqlite:///...``, ``postgresql://...``) as Optuna reads it,
    or else a file path, Optuna's journal file: no database server, and it works on the shared filesystem that a
    cluster's nodes see (its lock is a symlink, atomic on NFS)."""
    import optuna
    from optuna.storages.journal import JournalFileBackend

    if "://" in storage:
        # SQLite waits 5 s for a writer's lock by default; the jobs of a parallel sweep report at the same moments.
        timeout = {"connect_args": {"timeout": 60}} if storage.startswith("sqlite") else {}
        return optuna.storages.RDBStorage(storage, engine_kwargs=timeout)
    Path(storage).parent.mkdir(parents=True, exist_ok=True)
    return optuna.storages.JournalStorage(JournalFileBackend(storage))


def job_trial(hydra_cfg: DictConfig) -> dict[str, Any] | None:
    """The trial of this job of a search (None outside one): its study, number (the job's: the sweeper numbers its
    jobs as the study numbers its trials), params, and the storage and pruner the job reports to."""
    sweeper = hydra_cfg.sweeper
    if hydra_cfg.mode != RunMode.MULTIRUN or sweeper.get("_target_") != SWEEPER:
        return None
    if sweeper.storage is None or sweeper.study_name is None:
        return None  # a study in the sweeper's memory, or named by Optuna: the jobs cannot find it
    storage = open_storage(sweeper.storage)
    study_id = storage.get_study_id_from_name(sweeper.study_name)
    number = int(hydra_cfg.job.num)
    trial = storage.get_trial(storage.get_trial_id_from_study_id_trial_number(study_id, number))
    return {
        "study": sweeper.study_name,
        "number": number,
        "params": trial.params,
        "storage": sweeper.storage,
        "pruner": OmegaConf.to_container(sweeper.pruner) if sweeper.pruner is not None else None,
    }


class PruneTrial(L.Callback):
    """After each validation rank 0 reports ``metric`` to the job's trial (step: the validations before this one)
    and asks the study's pruner; one all-reduce tells every rank, and all set Lightning's ``should_stop`` at the
    same point, so they stop after the same batch, as ``StopTogether`` does on SIGTERM. ``pruned`` then says so
    (``result.json``'s status), and the sweeper records the trial as PRUNED.

    The validation count travels in checkpoints, so a resumed job goes on reporting where it stopped."""

    def __init__(self, trial: DictConfig, metric: str) -> None:
        self.trial, self.metric = trial, metric
        self.validations = 0
        self.pruned = False
        self._optuna_trial: Any = None  # rank 0's, opened at the first report

    def _open_trial(self) -> Any:
        import optuna
        from hydra.utils import instantiate

        study = optuna.load_study(
            study_name=self.trial.study,
            storage=open_storage(self.trial.storage),
            sampler=optuna.samplers.RandomSampler(),  # nothing is sampled here: the sweeper sampled the params
            pruner=instantiate(self.trial.pruner),
        )
        storage = study._storage  # Optuna's own lookup of a trial by number (what Study.trials would load in full)
        return optuna.trial.Trial(
            study, storage.get_trial_id_from_study_id_trial_number(study._study_id, self.trial.number)
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return  # mode=eval's one validation is the result, not a step of training
        prune = torch.zeros((), device=trainer.strategy.root_device)
        if trainer.is_global_zero and self.metric in trainer.callback_metrics:
            if self._optuna_trial is None:
                self._optuna_trial = self._open_trial()
            value = float(trainer.callback_metrics[self.metric])
            self._optuna_trial.report(value, step=self.validations)
            if self._optuna_trial.should_prune():
                prune.fill_(1)
                log.info(
                    f"Trial {self.trial.number} pruned by {cast(Any, self.trial.pruner)['_target_']} after validation "
                    f"{self.validations} ({self.metric}={value:.6g})."
                )
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            dist.all_reduce(prune, op=dist.ReduceOp.MAX)
        self.validations += 1
        if bool(prune):
            self.pruned = True
            trainer.should_stop = True
            log.info(f"Trial {self.trial.number} pruned: this rank stops after global step {trainer.global_step}.")

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self.validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validations = int(state_dict["validations"])
