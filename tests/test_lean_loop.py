"""``project.launch.lean_loop``: Lightning's loop with less host time, and the same hooks called in the same order.

Lightning's own function is the reference: a fit with every hook of two callbacks recorded (one overriding each
hook, one overriding a few), with and without ``lighten``, must record the same calls, the module's training step
must get ``batch_idx`` exactly when it takes it, and the private names replaced must still be Lightning's.
"""

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer import call
from torch import nn

from project.launch import lean_loop

HOOKS = [name for name in dir(L.Callback) if name.startswith("on_")]


class EveryHook(L.Callback):
    """Records each hook Lightning calls on it, in order."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls


for _name in HOOKS:

    def _record(self, *args, _name=_name, **kwargs) -> None:
        self.calls.append(_name)

    setattr(EveryHook, _name, _record)


class SomeHooks(L.Callback):
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.calls.append(f"some.on_train_batch_end.{batch_idx}")

    def on_validation_end(self, trainer, pl_module) -> None:
        self.calls.append("some.on_validation_end")


class Module(L.LightningModule):
    def __init__(self, with_batch_idx: bool) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)
        self.seen: list[int | None] = []
        if not with_batch_idx:
            self.training_step = self._step_without_index  # type: ignore[method-assign]

    def training_step(self, batch, batch_idx):
        self.seen.append(batch_idx)
        return self.net(batch).sum()

    def _step_without_index(self, batch):
        self.seen.append(None)
        return self.net(batch).sum()

    def validation_step(self, batch, batch_idx):
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(lean: bool, with_batch_idx: bool = True) -> tuple[list[str], list[int | None]]:
    calls: list[str] = []
    module = Module(with_batch_idx)
    trainer = L.Trainer(
        max_epochs=2,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[EveryHook(calls), SomeHooks(calls)],
    )
    lightning_call = call._call_callback_hooks
    try:
        if lean:
            lean_loop.lighten(trainer)
        data = torch.utils.data.DataLoader(torch.randn(6, 4), batch_size=2)
        trainer.fit(module, data, data)
    finally:
        call._call_callback_hooks = lightning_call  # other tests' trainers get Lightning's own
    return calls, module.seen


def test_lightened_loop_calls_every_overridden_hook_as_lightning_does():
    assert fit(lean=True) == fit(lean=False)
    calls, seen = fit(lean=True)
    assert "on_train_batch_end" in calls and "some.on_train_batch_end.2" in calls and "some.on_validation_end" in calls
    assert seen == [0, 1, 2, 0, 1, 2]


def test_a_training_step_without_batch_idx_gets_none():
    assert fit(lean=True, with_batch_idx=False) == fit(lean=False, with_batch_idx=False)
    assert fit(lean=True, with_batch_idx=False)[1] == [None] * 6


def test_a_callback_that_overrides_nothing_is_not_called(monkeypatch):
    called = []
    monkeypatch.setattr(L.Callback, "state_key", property(lambda self: called.append(self) or "key"))
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[L.Callback()])
    lean_loop._call_overriding_callbacks(trainer, "on_train_batch_start", None, None, 0)
    assert called == []  # Lightning's own builds each callback's profiler name, no-op or not


@pytest.mark.parametrize("name", ["_call_callback_hooks"])
def test_lightning_still_has_what_is_replaced(name):
    assert callable(getattr(call, name))
    loop = L.Trainer(logger=False).fit_loop.epoch_loop
    assert callable(loop._build_kwargs) and callable(loop._broadcast_sigterm_tensor)
