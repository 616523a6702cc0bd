"""W&B logging per epoch: online when the user is logged in and W&B is reachable, offline (syncable) otherwise."""

import netrc
import os
import socket
from collections.abc import Mapping
from typing import Any, Literal, cast
from urllib.parse import urlparse

import platformdirs
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from omegaconf import DictConfig, OmegaConf

from project.options.config_rules import ConfigRules, RunData
from project.options.errors import check_writable
from project.options.option_types import PositiveFloat


def _has_wandb_credentials(host: str) -> bool:
    """``wandb login`` stores the key in ~/.netrc; WANDB_API_KEY overrides it."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError):
        return False


def _reachable(host: str, port: int, timeout_s: float) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def resolve_wandb_mode(mode: str | None, timeout_s: float = 3.0) -> str:
    """``mode`` if given, else WANDB_MODE, else online only when logged in and the server answers.

    Deciding before ``wandb.init`` is what keeps a machine without network from waiting on W&B's own
    init timeout (90 s) and then failing the run.
    """
    mode = mode or os.environ.get("WANDB_MODE")
    if mode:
        return mode
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host = url.hostname or "api.wandb.ai"
    port = url.port or (443 if url.scheme == "https" else 80)
    if _has_wandb_credentials(host) and _reachable(host, port, timeout_s):
        return "online"
    return "offline"


class EpochRows:
    """One row per epoch (or per validation) from Lightning's logging calls, each with the optimizer ``step``.

    Lightning logs an epoch in two calls: the validation metrics when validation ends, then the training metrics
    (with the callbacks' ``perf/*`` and ``memory/*``) when the epoch ends. ``add`` gathers them and returns the
    epoch's row once the training call has closed it (and a row left open by a run stopped during its epoch, when
    the next epoch's metrics come); ``flush`` returns what is still open. A validation within the epoch
    (``trainer.val_check_interval``) has a row of its own: the next validation, step row or epoch's end at a later
    step closes it. ``step/*`` rows (every ``trainer.log_every_n_steps``) pass through on their own.
    """

    def __init__(self) -> None:
        self._row: dict[str, float] = {}

    def add(self, metrics: Mapping[str, float], step: int | None = None) -> list[dict[str, float]]:
        if any(key.startswith("step/") for key in metrics):  # ours, stamped with the steps taken
            # Training went on after a validation within the epoch: its row is complete.
            ready = self.flush() if _has_split(self._row, "val") else []
            # (Step rows come with their step: TrainingModule.on_before_optimizer_step passes it.)
            return [*ready, {**metrics, "step": step}]  # type: ignore[dict-item]
        # Lightning stamps its rows in training with the 0-based index of the last step taken; rows here say how
        # many steps were taken, as the step rows do.
        stamp = {} if step is None else {"step": step + 1}
        ready = []
        new_epoch = metrics.get("epoch", self._row.get("epoch")) != self._row.get("epoch")
        after_validation = _has_split(self._row, "val") and (
            _has_split(metrics, "val")  # the next validation
            or self._row.get("step") != stamp.get("step", self._row.get("step"))  # an epoch's end steps after it
        )
        if self._row and (new_epoch or after_validation):
            ready += self.flush()
        self._row.update(metrics)
        self._row.update(stamp)
        if _has_split(metrics, "train"):
            ready += self.flush()
        return ready

    def flush(self) -> list[dict[str, float]]:
        row, self._row = self._row, {}
        return [row] if row else []


def _has_split(metrics: Mapping[str, float], split: str) -> bool:
    return any(key.startswith(f"{split}/") for key in metrics)


class EpochCSVLogger(CSVLogger):
    """Lightning's CSVLogger with one row per epoch, training and validation together (``EpochRows``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._rows = EpochRows()

    # Lightning hands its loggers floats (its logger connector converts tensors), as the rows here hold.
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:  # type: ignore[override]
        for row in self._rows.add(metrics, step):
            self._write(row)

    def _write(self, row: dict[str, float]) -> None:
        # The CSV's `step` column is Lightning's own, from the step argument.
        step = cast(int | None, row.get("step"))  # a count of steps
        super().log_metrics({key: value for key, value in row.items() if key != "step"}, step)

    @rank_zero_only
    def finalize(self, status: str) -> None:
        for row in self._rows.flush():
            self._write(row)
        super().finalize(status)


class EpochWandbLogger(WandbLogger, ConfigRules):
    """Lightning's WandbLogger with one history row per epoch (``EpochRows``) and one x-axis for every chart:
    ``x_axis`` ``epoch``, or ``step`` (optimizer steps) for runs validated every N steps; the ``step/*`` rows are
    always charted by step. Every row holds both, so either can be chosen in the W&B UI. The run's summary holds
    each key's final value, and under ``best/<key>`` its value in the best row by ``summary_metric``
    (``summary_mode`` max or min).

    ``mode``: online / offline / disabled, or None to decide with :func:`resolve_wandb_mode`. If an online start
    still fails (after ``init_timeout_s``), the run logs offline instead of failing.
    """

    def __init__(
        self,
        mode: Literal["online", "offline", "disabled"] | None = None,
        summary_metric: str = "val/acc",
        summary_mode: Literal["max", "min"] = "max",
        x_axis: str = "epoch",
        init_timeout_s: PositiveFloat = 30.0,
        **kwargs: Any,
    ) -> None:
        import wandb  # here, not at the top: a run with other loggers does not pay its import (~0.6 s)

        # quiet: W&B's own lines at start and its history and summary at the end (a third of a default run's
        # console) stay off the console; the job's outputs list says where the run is and how to upload it.
        settings = wandb.Settings(init_timeout=init_timeout_s, quiet=True)
        super().__init__(mode=resolve_wandb_mode(mode), settings=settings, **kwargs)
        # Lightning 2.6 always passes `anonymous`, which wandb 0.31 deprecated with a warning on every run.
        self._wandb_init.pop("anonymous", None)
        self.summary_metric = summary_metric
        self.summary_mode = summary_mode
        self.x_axis = x_axis
        self._rows = EpochRows()
        self._best: dict[str, float] | None = None

    @staticmethod
    def check_run_config(cfg: DictConfig, node: str, data: RunData) -> None:
        """Where W&B writes, which must be writable before launch: the run's ``save_dir``, its staging dir for
        logged tables and its cache (``WANDB_DATA_DIR`` and ``WANDB_CACHE_DIR``, by default under HOME).

        The two defaults are wandb.env's ``get_data_dir`` and ``get_cache_dir``, spelt out: importing wandb (2 s)
        would slow every launcher down, and the launcher of a multi-process job never logs itself."""
        mode = OmegaConf.select(cfg, f"{node}.mode")
        if mode == "disabled" or os.environ.get("WANDB_MODE") == "disabled":
            return
        save_dir = OmegaConf.select(cfg, f"{node}.save_dir") or "."
        check_writable(f"{node}.save_dir", save_dir, f"set {node}.save_dir to a dir you can write.")
        for variable, directory in (
            ("WANDB_DATA_DIR", os.environ.get("WANDB_DATA_DIR", platformdirs.user_data_dir("wandb"))),
            ("WANDB_CACHE_DIR", os.environ.get("WANDB_CACHE_DIR", platformdirs.user_cache_dir("wandb"))),
        ):
            check_writable(
                node,
                directory,
                f"W&B writes there: set the environment variable {variable} to a dir you can write, or log with "
                "logger=csv.",
            )

    @property
    @rank_zero_only
    def experiment(self):
        # Started here rather than by Lightning, which would define its own step metric beside `epoch`.
        if self._experiment is None:
            self._experiment = self._start_run()
            for axis in ("epoch", "step"):
                self._experiment.define_metric(axis)
            self._experiment.define_metric("step/train_loss", step_metric="step")  # a name, so no glob competes
            self._experiment.define_metric("*", step_metric=self.x_axis)
        return self._experiment

    def _start_run(self):
        import wandb

        try:
            return wandb.init(**self._wandb_init)
        except Exception as error:  # noqa: BLE001 - any failure to reach W&B must not end the training run
            if self._wandb_init.get("mode") != "online":
                raise
            rank_zero_warn(f"W&B could not start online ({error}); logging offline instead (sync later).")
            self._wandb_init["mode"] = "offline"
            return wandb.init(**self._wandb_init)

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        for row in self._rows.add(metrics, step):
            self._send_row(row)

    @rank_zero_only
    def log_summary_table(self, key: str, rows: list[dict[str, Any]]) -> None:
        """``rows`` as the W&B table ``key`` in the run's summary (replacing the one before): the latest epoch's
        row per device (``devices``: memory, throughput, to compare devices and strategies side by side), or the
        text samples so far (``samples``)."""
        import wandb

        if rows:
            columns = list(rows[0])
            table = wandb.Table(
                columns=cast(list[str | int], columns), data=[[row.get(column) for column in columns] for row in rows]
            )
            experiment = self.experiment
            assert experiment is not None  # rank 0's (rank_zero_only): this runs on rank 0 only
            experiment.summary[key] = table

    def _send_row(self, row: dict[str, float]) -> None:
        experiment = self.experiment
        assert experiment is not None  # rank 0's (rank_zero_only): this runs on rank 0 only
        experiment.log(row)
        if any(key.startswith("step/") for key in row):
            return  # step rows are not epochs: they do not move best/<key>
        value = row.get(self.summary_metric)
        if value is not None and (self._best is None or self._is_better(value, self._best[self.summary_metric])):
            self._best = row
        if self._best is not None:
            experiment.summary.update({f"best/{key}": value for key, value in self._best.items()})

    def _is_better(self, value: float, best: float) -> bool:
        return value > best if self.summary_mode == "max" else value < best

    @rank_zero_only
    def finalize(self, status: str) -> None:
        for row in self._rows.flush():
            self._send_row(row)
        super().finalize(status)
