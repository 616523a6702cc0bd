"""``hydra/sweeper=optuna``: an Optuna study as a Hydra multirun, one job per trial, on today's Optuna.

Why our own: hydra-optuna-sweeper (1.3.0, its last release) requires ``optuna<3``, and with it ``sqlalchemy<2``. Its
config surface is kept (``params`` in Hydra's sweep grammar, ``direction``, ``n_trials``, ``n_jobs``, ``sampler`` and
``storage`` by ``_target_``, ``study_name``, ``max_failure_rate``), and this adds what it lacks:

- ``storage`` may be a file path, Optuna's journal file (``hparams_search`` puts one in the sweep dir);
- ``pruner`` (by ``_target_``): each job's rank 0 reports the optimized metric after every validation, and a job
  the pruner stops records ``pruned``, which the study records as PRUNED (``project.launch.trial``);
- the same command in the same sweep dir continues an interrupted study: trials that ended count towards
  ``n_trials``, those that were running are recorded as failed (and their jobs as interrupted), new jobs are
  numbered after every earlier one, so that job N is trial N and its dir ``<sweep dir>/N``, and a seeded sampler
  is seeded with its seed plus the trials already there (with its own seed it would ask their parameters again);
- a study belongs to the search (the sweep dir) that made it: a search in another sweep dir, or with another
  direction or ``optimized_metric``, is refused before any trial starts, so no search touches another's trials. The
  owner's liveness, named in the refusal, is its sweep dir's lock (``project.launch.job_dir``): held by the live
  sweep process, free once it has ended however it ended.

It lives in the ``hydra_plugins`` namespace because Hydra finds sweepers only there. Hydra imports every plugin
module at start-up, so optuna is imported only when a search starts.
"""

import logging
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, Override, RangeSweep, Transformer
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from project.launch.results import RESULT_FILE, mark_interrupted, read_result
from project.options.errors import ConfigError, check_writable, exit_with

log = logging.getLogger(__name__)


@dataclass
class OptunaSweeperConf:
    """``hydra.sweeper``'s keys (conf/hparams_search/optuna.yaml comments each)."""

    # conf/hydra/sweeper/{sampler,pruner}/ hold the options, chosen as hydra/sweeper/sampler=random and the like.
    defaults: list[Any] = field(default_factory=lambda: ["_self_", {"sampler": "tpe"}, {"pruner": None}])
    _target_: str = "hydra_plugins.project_sweeper.optuna_sweeper.OptunaSweeper"
    sampler: Any = None  # an Optuna sampler by _target_; None: Optuna's default (TPE)
    pruner: Any = None  # an Optuna pruner by _target_; None: no trial is stopped early
    direction: Any = "minimize"  # minimize | maximize, or a list of them for several objectives
    storage: Any = None  # an RDB URL or a journal file path; None: in memory (no continuing, no pruning)
    study_name: Any = None  # the study's name in the storage; None: Optuna picks one
    n_trials: int = 20  # trials in all, over every run of the command in the same sweep dir
    n_jobs: int = 1  # trials asked and launched together (a parallel launcher runs them at once)
    max_failure_rate: float = 0.0  # a batch with more failed trials than this share stops the search
    params: Any = None  # the search space: key -> Hydra sweep (choice, range, interval, tag(log, ...))


ConfigStore.instance().store(group="hydra/sweeper", name="optuna", node=OptunaSweeperConf, provider="project")


def distribution(override: Override) -> Any:
    """The Optuna distribution of a sweep override, as hydra-optuna-sweeper reads them but for ``range``, whose end
    is left out as everywhere in Hydra's grammar: ``choice(...)`` categorical, ``range(a, b[, step])`` integers (or
    floats, stepped), ``interval(a, b)`` uniform (integers if both ends are), ``tag(log, interval(a, b))`` on a log
    scale; a shuffled range is categorical."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    value = override.value()
    if isinstance(value, ChoiceSweep) or (isinstance(value, RangeSweep) and value.shuffle):
        return CategoricalDistribution(list(override.sweep_iterator(transformer=Transformer.encode)))
    if isinstance(value, RangeSweep):
        values = list(override.sweep_iterator())
        if any(isinstance(end, float) for end in (value.start, value.stop, value.step)):
            return FloatDistribution(values[0], values[-1], step=value.step)
        return IntDistribution(int(values[0]), int(values[-1]), step=int(value.step))
    if isinstance(value, IntervalSweep):
        log_scale = "log" in value.tags
        key = override.get_key_element()
        if value.start > value.end:
            raise ConfigError(
                key,
                f"searches interval({value.start}, {value.end}), whose low end is above its high end.",
                f"give the low end first: interval({value.end}, {value.start}).",
            )
        if log_scale and value.start <= 0:
            raise ConfigError(
                key,
                f"searches interval({value.start}, {value.end}) on a log scale, which needs ends above 0.",
                ("give it a low end above 0, or search it without tag(log, ...)."),
            )
        if isinstance(value.start, int) and isinstance(value.end, int):
            return IntDistribution(value.start, value.end, log=log_scale)
        return FloatDistribution(value.start, value.end, log=log_scale)
    raise ConfigError(
        override.get_key_element(),
        f"is {override.input_line}, not a sweep Optuna can search.",
        "search it with choice(...), range(...) or interval(...), or give it one value.",
    )


def search_space(arguments: list[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """The searched keys' distributions, and the fixed ``key=value`` overrides: a key given a plain value (on the
    command line, after ``params``) is not searched."""
    space: dict[str, Any] = {}
    fixed: dict[str, str] = {}
    for override in OverridesParser.create().parse_overrides(arguments):
        key = override.get_key_element()
        if override.is_sweep_override():
            space[key] = distribution(override)
            fixed.pop(key, None)
        else:
            fixed[key] = override.get_value_element_as_str()
            space.pop(key, None)
    return space, fixed


class OptunaSweeper(Sweeper):
    """Ask ``n_jobs`` trials, launch them as jobs, tell the study each job's outcome (its return value, or PRUNED
    and FAIL from its ``result.json``), until ``n_trials`` have ended."""

    def __init__(
        self,
        sampler: Any,
        pruner: Any,
        direction: Any,
        storage: str | None,
        study_name: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        params: DictConfig | None,
    ) -> None:
        self.sampler, self.pruner, self.storage, self.study_name = sampler, pruner, storage, study_name
        self.directions = [direction] if isinstance(direction, str) else list(direction)
        self.n_trials, self.n_jobs, self.max_failure_rate = n_trials, max(1, n_jobs), max_failure_rate
        self.params = {str(key): str(value) for key, value in (params or {}).items()}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )
        self.sweep_dir = Path(config.hydra.sweep.dir)

    def sweep(self, arguments: list[str]) -> None:
        import optuna

        from project.launch.trial import open_storage  # imports Lightning: not at Hydra's start-up

        try:
            space, fixed = search_space([f"{key}={value}" for key, value in self.params.items()] + arguments)
        except ConfigError as error:
            exit_with(error)
        self._check_setup()
        study = optuna.create_study(
            study_name=self.study_name,
            storage=None if self.storage is None else self._open_storage(open_storage),
            sampler=self.sampler,
            pruner=self.pruner,
            directions=self.directions,
            load_if_exists=True,
        )
        self._check_study(study)
        to_go, job_num = self._continue(study)
        log.info(
            f"Study {study.study_name} ({self.storage or 'in memory'}): {to_go} trials to run, {self.n_jobs} at a time."
        )
        while to_go > 0:
            trials = [study.ask(space) for _ in range(min(self.n_jobs, to_go))]
            numbers = [trial.number for trial in trials]
            if numbers != list(range(job_num, job_num + len(trials))):
                raise RuntimeError(
                    f"Study {study.study_name} numbered these trials {numbers}, not as the jobs from {job_num}: "
                    "another search writes the same study. Give each its own hydra.sweeper.study_name."
                )
            overrides = [
                tuple(f"{key}={value}" for key, value in {**trial.params, **fixed}.items()) for trial in trials
            ]
            returns = self.launcher.launch(overrides, initial_job_idx=job_num)
            job_num += len(returns)
            to_go -= len(returns)
            failed = [self._tell(study, trial, job) for trial, job in zip(trials, returns)].count(False)
            if failed / len(returns) > self.max_failure_rate:
                for job in returns:
                    job.return_value  # noqa: B018 (raises a failed job's own exception, as Hydra's sweepers do)
                raise RuntimeError(
                    f"{failed} of {len(returns)} trials failed, more than hydra.sweeper.max_failure_rate="
                    f"{self.max_failure_rate}; see their result.json files."
                )
        self._report(study)

    def _check_setup(self) -> None:
        """Settings that cannot work, refused before any trial starts, naming the key and the fix."""
        wrong = [direction for direction in self.directions if direction not in ("minimize", "maximize")]
        if wrong and wrong[0] == OmegaConf.select(self.config, "optimized_metric.mode"):  # what the direction is of
            exit_with(ConfigError("optimized_metric.mode", f"is {wrong[0]!r}.", "use max (higher is better) or min."))
        if wrong:
            exit_with(
                ConfigError(
                    "hydra.sweeper.direction",
                    f"has {wrong[0]!r}, which is neither minimize nor maximize.",
                    "use minimize or maximize (a list of them for several objectives), or leave it to "
                    "optimized_metric.mode.",
                )
            )
        if isinstance(self.n_trials, bool) or not isinstance(self.n_trials, int) or self.n_trials < 1:
            exit_with(
                ConfigError(
                    "hydra.sweeper.n_trials",
                    f"must be a positive integer, got {self.n_trials!r}.",
                    "set hydra.sweeper.n_trials=20, say.",
                )
            )
        if not 0 <= self.max_failure_rate <= 1:
            exit_with(
                ConfigError(
                    "hydra.sweeper.max_failure_rate",
                    f"is {self.max_failure_rate}, but it is a share of a batch's trials: from 0 to 1.",
                    "use 0 (stop at the first failed trial) up to 1 (never stop for failures).",
                )
            )
        returned = 1 + len(OmegaConf.select(self.config, "optimized_metric.also", default=None) or [])
        if "optimized_metric" in self.config and len(self.directions) != returned:
            exit_with(
                ConfigError(
                    "hydra.sweeper.direction",
                    f"lists {len(self.directions)} direction(s), but each job returns {returned} value(s): "
                    "optimized_metric.name's, and those of optimized_metric.also's metrics.",
                    "give one direction per value, e.g. hydra.sweeper.direction=[minimize,maximize] "
                    "'optimized_metric.also=[val/acc]'.",
                )
            )
        if self.pruner is not None and len(self.directions) > 1:
            exit_with(
                ConfigError(
                    "hydra.sweeper.pruner",
                    "is set, but Optuna prunes single-objective studies only.",
                    "set hydra.sweeper.pruner=null for a multi-objective search.",
                )
            )
        if self.pruner is not None and (self.storage is None or self.study_name is None):
            exit_with(
                ConfigError(
                    "hydra.sweeper.pruner",
                    "needs a study the jobs can find, in a storage under a name.",
                    "set hydra.sweeper.storage and study_name (hparams_search=optuna sets both), or "
                    "hydra.sweeper.pruner=null.",
                )
            )

    def _check_study(self, study: Any) -> None:
        """A study another search made, or made for another objective, is refused: its trials are that search's
        jobs (trial N is ``<its sweep dir>/N``), and values of another metric or direction do not compare. A new
        study records what it is for."""
        from optuna.study import StudyDirection

        from project.launch.job_dir import live_holder

        metric = [OmegaConf.select(self.config, "optimized_metric.name")]
        metric += list(OmegaConf.select(self.config, "optimized_metric.also", default=None) or [])
        owner = {"sweep_dir": str(self.sweep_dir.resolve()), "optimized_metric": metric}
        if not study.get_trials(deepcopy=False) and not study.user_attrs:
            for key, value in owner.items():
                study.set_user_attr(key, value)
            return
        where = f"study {study.study_name} in {self.storage}"
        directions = [direction.name.lower() for direction in study.directions]
        if [StudyDirection[d.upper()] for d in self.directions] != list(study.directions):
            exit_with(
                ConfigError(
                    "hydra.sweeper.direction",
                    f"is {self.directions}, but {where} was made to {directions}: its values would not compare.",
                    "continue it as it was made, or give this search a study of its own (hydra.sweeper.study_name, "
                    "or a new hydra.sweep.dir).",
                )
            )
        made_for = study.user_attrs.get("optimized_metric", metric)
        if made_for != metric:
            exit_with(
                ConfigError(
                    "optimized_metric.name",
                    f"is {metric[0]} (with also: {metric[1:]}), but {where} ranks trials by {made_for[0]} (with "
                    f"also: {made_for[1:]}): its values would not compare.",
                    f"continue it with optimized_metric.name={made_for[0]}, or give this search a study of its own "
                    "(hydra.sweeper.study_name, or a new hydra.sweep.dir).",
                )
            )
        sweep_dir = study.user_attrs.get("sweep_dir", owner["sweep_dir"])
        if sweep_dir != owner["sweep_dir"]:
            holder = live_holder(sweep_dir)
            state = f"running now ({holder})" if holder else "not running"
            exit_with(
                ConfigError(
                    "hydra.sweeper.study_name",
                    f"names {where}, whose trials are the jobs of the search in {sweep_dir}, {state}; a search "
                    "continues its own study only, so that no trial of another is touched.",
                    f"give this search its own study name (hydra.sweeper.study_name=...), or continue that one "
                    f"from its dir (hydra.sweep.dir={sweep_dir}).",
                )
            )

    def _open_storage(self, open_storage: Any) -> Any:
        """The study storage, or a refusal naming it: an RDB URL that does not open, a journal it cannot write."""
        assert self.storage is not None
        fix = (
            "give a journal file in a dir you can write (the default: <sweep dir>/optuna.journal), or an RDB URL "
            "that opens: sqlite:///<file>, postgresql://user:password@host/db."
        )
        if "://" not in self.storage:
            try:
                check_writable("hydra.sweeper.storage", Path(self.storage).parent, fix)
            except ConfigError as error:
                exit_with(error)
        try:
            return open_storage(self.storage)
        except Exception as error:  # SQLAlchemy's, a driver's, the journal's: whatever says why it does not open
            message = " ".join(str(error).split())[:300]
            exit_with(ConfigError("hydra.sweeper.storage", f"{self.storage} cannot be opened: {message}", fix))

    def _continue(self, study: Any) -> tuple[int, int]:
        """Trials to go and the next job's number, where the study already has trials: this search's (the study's
        sweep dir is this one, whose lock this process holds, so none of its trials is another's live one)."""
        from optuna.trial import TrialState

        trials = study.get_trials(deepcopy=False)
        if not trials:
            return self.n_trials, 0
        sampler = OmegaConf.select(self.config, "hydra.sweeper.sampler")
        if sampler is not None and sampler.get("seed") is not None:
            # Seeded as configured, it would ask the first trials' parameters again: seeded after them instead.
            study.sampler = instantiate(sampler, seed=int(sampler.seed) + len(trials))
        for trial in trials:
            if trial.state == TrialState.RUNNING:
                study.tell(trial.number, state=TrialState.FAIL)
                mark_interrupted(self.sweep_dir / str(trial.number))
                log.warning(f"Trial {trial.number} was running when the sweep stopped: recorded as failed.")
        ended = sum(
            trial.state != TrialState.RUNNING and _status(self.sweep_dir / str(trial.number)) != "interrupted"
            for trial in trials
        )
        to_go = max(0, self.n_trials - ended)
        log.info(f"Continuing study {study.study_name}: {ended} trials ended, {to_go} to go.")
        return to_go, len(trials)

    def _tell(self, study: Any, trial: Any, job: JobReturn) -> bool:
        """Record the job's outcome in the study; False for a failed trial."""
        from optuna.trial import TrialState

        job_dir = Path(job.hydra_cfg.hydra.runtime.output_dir) if job.hydra_cfg else self.sweep_dir / str(trial.number)
        result = read_result(job_dir / RESULT_FILE) or {}
        if result.get("status") == "pruned":
            study.tell(trial, state=TrialState.PRUNED)
            return True
        value = job._return_value if job.status == JobStatus.COMPLETED else None
        values = [value] if isinstance(value, (int, float)) else list(value) if isinstance(value, (list, tuple)) else []
        if len(values) != len(self.directions) or None in values:
            study.tell(trial, state=TrialState.FAIL)
            reason = result.get("error") or (
                job._return_value
                if job.status == JobStatus.FAILED
                else f"it returned {value!r}, for {len(self.directions)} direction(s)"
            )
            log.warning(f"Trial {trial.number} failed: {reason}")
            return False
        study.tell(trial, values=[float(v) for v in values])
        return True

    def _report(self, study: Any) -> None:
        """The study's trials by state, the best, ``optimization_results.yaml``, and the dashboard's command."""
        from optuna.trial import TrialState

        states = [trial.state for trial in study.get_trials(deepcopy=False)]
        counts = ", ".join(f"{states.count(state)} {state.name.lower()}" for state in TrialState if state in states)
        log.info(f"Study {study.study_name}: {len(states)} trials ({counts}).")
        if TrialState.COMPLETE not in states:
            results: dict[str, Any] = {"name": "optuna", "best_params": None}
        elif len(self.directions) == 1:
            best = study.best_trial
            results = {
                "name": "optuna",
                "best_trial": best.number,
                "best_params": best.params,
                "best_value": best.value,
            }
            log.info(f"Best trial: {best.number}, value {best.value:.6g}, params {best.params}")
        else:
            front = [{"trial": t.number, "params": t.params, "values": t.values} for t in study.best_trials]
            results = {"name": "optuna", "solutions": front}
            log.info(f"Pareto front: trials {sorted(t['trial'] for t in front)}")
        OmegaConf.save(OmegaConf.create(results), self.sweep_dir / "optimization_results.yaml")
        if self.storage is not None:
            from project.observability.console import program

            log.info(f"Browse the study: {program('optuna-dashboard')} {shlex.quote(str(self.storage))}")


def _status(job_dir: Path) -> str | None:
    return (read_result(job_dir / RESULT_FILE) or {}).get("status")
