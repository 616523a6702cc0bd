r"""Where a framework step's host time goes (docs/speed.md), added to any run as a callback:

    python train.py logger=csv trainer.max_epochs=4 \
        +callbacks.breakdown._target_=benchmarks.step_breakdown.StepBreakdown

Wall-clock timers around the parts of Lightning's training step and this project's own, from the first training
batch on: the step (``_TrainingEpochLoop.advance``), the forward and loss (the module's ``training_step``; of it,
the net's forward), ``backward``, the optimizer's step (of it, its update) and ``zero_grad``, the next batch
(Lightning's fetcher), each callback hook (Lightning's ``_call_callback_hooks``), and Lightning's work after each
step, outside it (``on_advance_end``: LR schedulers, logging, checks; at an epoch's end, the validation too). At
the end of training, milliseconds per training step, with what is left of the step: Lightning's own loop. Lines
starting "of it" are parts of another. (Validation's forwards count in the net's forward.)
"""

import collections
import functools
import importlib
import time
from collections.abc import Callable
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loops import fetchers, training_epoch_loop
from lightning.pytorch.trainer import call

# The callback hooks Lightning calls inside a training step
STEP_HOOKS = {
    "on_train_batch_start",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_before_zero_grad",
    "on_train_batch_end",
}


class StepBreakdown(L.Callback):
    def __init__(self) -> None:
        self.seconds: collections.Counter[str] = collections.Counter()
        self._restore: list[tuple[Any, str, Callable]] = []

    def _time(self, owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        seconds = self.seconds

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                seconds[label] += time.perf_counter() - start

        setattr(owner, name, timed)
        self._restore.append((owner, name, original))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._time(training_epoch_loop._TrainingEpochLoop, "advance", "step")
        # Between steps, outside ``advance``: LR schedulers, step logging, validation and stopping checks
        self._time(training_epoch_loop._TrainingEpochLoop, "on_advance_end", "after the step (Lightning's, outside it)")
        self._time(fetchers._PrefetchDataFetcher, "__next__", "next batch")
        self._time(type(pl_module), "training_step", "forward and loss")
        self._time(type(pl_module.net), "forward", "of it, the net's forward")
        self._time(torch.Tensor, "backward", "backward")
        for optimizer in trainer.optimizers:
            self._time(optimizer, "step", "optimizer step (with the closure: forward, loss, backward)")
            self._time(optimizer, "zero_grad", "zero_grad")
        for name in ("sgd", "adam", "adamw"):  # the optimizer's update itself, the function its step calls
            module = importlib.import_module(f"torch.optim.{name}")
            if hasattr(module, name):
                self._time(module, name, "of it, the optimizer's update")
        calls = self.seconds
        hooks = call._call_callback_hooks

        def callback_hooks(trainer: L.Trainer, hook_name: str, *args: Any, **kwargs: Any) -> None:
            start = time.perf_counter()
            try:
                hooks(trainer, hook_name, *args, **kwargs)
            finally:
                calls[f"callbacks: {hook_name}"] += time.perf_counter() - start

        call._call_callback_hooks = callback_hooks
        self._restore.append((call, "_call_callback_hooks", hooks))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for owner, name, original in reversed(self._restore):
            setattr(owner, name, original)
        steps = trainer.fit_loop.epoch_loop.batch_progress.total.processed  # type: ignore[attr-defined]
        per_step = {label: seconds / steps * 1e3 for label, seconds in self.seconds.items()}
        optimizer = per_step.pop("optimizer step (with the closure: forward, loss, backward)", 0.0)
        inside = per_step["forward and loss"] + per_step.get("backward", 0.0)
        per_step["optimizer step (the update, and the closure's hooks)"] = optimizer - inside
        outside = ("step", "after the step (Lightning's, outside it)")
        within = [label for label in per_step if label not in outside and not label.startswith("of it")]
        within = [label for label in within if not label.startswith("callbacks: ") or label[11:] in STEP_HOOKS]
        per_step["Lightning's loop (the rest of the step)"] = per_step["step"] - sum(per_step[key] for key in within)
        print(f"ms per training step, over {steps} steps (hooks outside the step: per training step too):")
        for label, value in sorted(per_step.items(), key=lambda item: -item[1]):
            if value >= 0.001:
                print(f"  {value:8.3f}  {label}")
