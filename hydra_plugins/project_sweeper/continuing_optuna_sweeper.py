"""hydra-optuna-sweeper's search, continued where an interrupted sweep stopped.

The plugin stores the study in the sweep dir (``hparams_search`` sets the storage), but run again in the same
dir it numbers its jobs from 0 again, over the earlier jobs' dirs, and runs ``n_trials`` more trials; the trial
that was running when the sweep stopped stays RUNNING in the study forever. This subclass only sets up the
continuation and then runs the plugin's own search.

It lives in the ``hydra_plugins`` namespace because Hydra instantiates sweepers only from there. Hydra imports
every plugin module at start-up, so optuna is imported only when a search starts.
"""

import logging
from pathlib import Path
from typing import Any

from project.launch.results import RESULT_FILE, mark_interrupted, read_result

try:
    from hydra_plugins.hydra_optuna_sweeper.optuna_sweeper import OptunaSweeper
except ImportError:  # no project[optuna] extra: Hydra finds no optuna sweeper config, and this module must still load
    OptunaSweeper = object

log = logging.getLogger(__name__)


class ContinuingOptunaSweeper(OptunaSweeper):
    """Run again with the same sweep dir, the search goes on: trials that ended count towards ``n_trials``, those
    that were running when the sweep stopped are recorded as failed (and their jobs as interrupted), and new jobs
    are numbered after every earlier one, so that job ``N``'s dir is trial ``N``'s."""

    def sweep(self, arguments: list[str]) -> None:
        from optuna.trial import TrialState

        search = self.sweeper  # the plugin's implementation, set up by Hydra
        study = self._stored_study(search.study_name, search.storage)
        if study is not None and study.trials:
            job_dir = Path(search.config.hydra.sweep.dir)
            trials = study.trials
            for trial in trials:
                if trial.state == TrialState.RUNNING:
                    study.tell(trial.number, state=TrialState.FAIL)
                    mark_interrupted(job_dir / str(trial.number))
                    log.warning(f"Trial {trial.number} was running when the sweep stopped: recorded as failed.")
            ended = sum(
                trial.state != TrialState.RUNNING and _status(job_dir / str(trial.number)) != "interrupted"
                for trial in trials
            )
            search.n_trials = max(0, search.n_trials - ended)
            search.job_idx = len(trials)
            log.info(f"Continuing study {study.study_name}: {ended} trials ended, {search.n_trials} to go.")
        super().sweep(arguments)

    @staticmethod
    def _stored_study(name: str, storage: Any) -> Any:
        """The study ``name`` in ``storage``, None if there is none yet."""
        import optuna

        if storage is None:
            return None
        try:
            return optuna.load_study(study_name=name, storage=storage)
        except KeyError:  # a new study
            return None


def _status(job_dir: Path) -> str | None:
    return (read_result(job_dir / RESULT_FILE) or {}).get("status")
