"""Lightning's training loop with less host time per step, and nothing else changed: what it runs, in what order.

A step of a small model is short enough that the loop's own Python shows in it (docs/speed.md measures it): on the
2-core CPU machine the default MLP's step is about 4 ms, and Lightning's loop around it took some 0.5 ms before
this. Lightning offers no switch for the two costs below, so they are replaced on the trainer (private names of
Lightning 2.6, each checked by ``tests/test_lean_loop.py``):

- every callback's every hook is called, the base class's no-ops included, each inside the profiler's context
  under a name built from the callback's state key (a checkpoint callback's is the repr of its settings): some
  sixty calls a training step with this project's callbacks. Here a hook is called only on the callbacks that
  override it; calling a no-op does nothing, and a profiler still sees each call that does something.
- the training step's signature is inspected at every step (whether it takes ``batch_idx``), with
  ``inspect.getfullargspec``; here once.
"""

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import Checkpoint, EarlyStopping
from lightning.pytorch.trainer import call
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

_OVERRIDES: dict[tuple[type, str], bool] = {}


def _overrides(kind: type, hook_name: str) -> bool:
    if (kind, hook_name) not in _OVERRIDES:
        _OVERRIDES[kind, hook_name] = getattr(kind, hook_name, None) is not getattr(L.Callback, hook_name, None)
    return _OVERRIDES[kind, hook_name]


def _call_overriding_callbacks(
    trainer: L.Trainer, hook_name: str, *args: Any, monitoring_callbacks: bool | None = None, **kwargs: Any
) -> None:
    """Lightning's ``lightning.pytorch.trainer.call._call_callback_hooks`` (2.6), calling the hook only on the
    callbacks whose class (or the instance itself) overrides it."""
    # Trainer.callbacks and .profiler are set by Lightning's connectors, which its class does not declare.
    every: list[L.Callback] = trainer.callbacks  # type: ignore[attr-defined]
    callbacks = [
        callback
        for callback in every
        if _overrides(type(callback), hook_name) or hook_name in getattr(callback, "__dict__", {})
    ]
    if monitoring_callbacks is True:
        callbacks = [callback for callback in callbacks if isinstance(callback, (EarlyStopping, Checkpoint))]
    elif monitoring_callbacks is False:
        callbacks = [callback for callback in callbacks if not isinstance(callback, (EarlyStopping, Checkpoint))]
    if not callbacks:
        return
    pl_module = trainer.lightning_module
    if pl_module:
        previous, pl_module._current_fx_name = pl_module._current_fx_name, hook_name
    for callback in callbacks:
        with trainer.profiler.profile(f"[Callback]{callback.state_key}.{hook_name}"):  # type: ignore[attr-defined]
            getattr(callback, hook_name)(trainer, trainer.lightning_module, *args, **kwargs)
    if pl_module:
        pl_module._current_fx_name = previous  # restore it when hooks nest


def lighten(trainer: L.Trainer) -> None:
    """Make ``trainer``'s loop inspect its training step once, and Lightning's loops (every trainer's in this
    process, from now on) call only the callback hooks that are overridden."""
    call._call_callback_hooks = _call_overriding_callbacks
    epoch_loop = trainer.fit_loop.epoch_loop
    takes_batch_idx: dict[Callable, bool] = {}

    def build_kwargs(kwargs: dict, batch: Any, batch_idx: int) -> dict:
        kwargs["batch"] = batch
        step = trainer.lightning_module.training_step
        method = getattr(step, "__func__", step)
        if method not in takes_batch_idx:
            takes_batch_idx[method] = is_param_in_hook_signature(step, "batch_idx", min_args=2)
        if takes_batch_idx[method]:
            kwargs["batch_idx"] = batch_idx
        return kwargs

    epoch_loop._build_kwargs = build_kwargs  # type: ignore[method-assign,assignment]
