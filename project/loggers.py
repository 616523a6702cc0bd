"""W&B logging per epoch: online when the user is logged in and W&B is reachable, offline (syncable) otherwise."""

import netrc
import os
import socket
from typing import Any
from urllib.parse import urlparse

import wandb
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn


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


class EpochWandbLogger(WandbLogger):
    """Lightning's WandbLogger with ``epoch`` as every chart's x-axis and the best ``summary_metric`` in the summary.

    ``mode``: online / offline / disabled, or None to decide with :func:`resolve_wandb_mode`. If an online start
    still fails (after ``init_timeout_s``), the run logs offline instead of failing.
    """

    def __init__(
        self,
        mode: str | None = None,
        summary_metric: str = "val/acc",
        summary_mode: str = "max",
        init_timeout_s: float = 30.0,
        **kwargs: Any,
    ) -> None:
        settings = wandb.Settings(init_timeout=init_timeout_s)
        super().__init__(mode=resolve_wandb_mode(mode), settings=settings, **kwargs)
        # Lightning 2.6 always passes `anonymous`, which wandb 0.31 deprecated with a warning on every run.
        self._wandb_init.pop("anonymous", None)
        self.summary_metric = summary_metric
        self.summary_mode = summary_mode

    @property
    @rank_zero_only
    def experiment(self):
        first_access = self._experiment is None
        try:
            run = WandbLogger.experiment.fget(self)
        except Exception as error:  # noqa: BLE001 - any failure to reach W&B must not end the training run
            if self._wandb_init.get("mode") != "online":
                raise
            rank_zero_warn(f"W&B could not start online ({error}); logging offline instead (sync later).")
            self._wandb_init["mode"] = "offline"
            run = WandbLogger.experiment.fget(self)
        if first_access:
            # Lightning logs `epoch` with every epoch-level dict; make it the x-axis of everything.
            run.define_metric("epoch")
            run.define_metric("*", step_metric="epoch")
            run.define_metric(self.summary_metric, step_metric="epoch", summary=self.summary_mode)
        return run
