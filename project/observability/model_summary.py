"""The model summary at the start of training: Lightning's, counting the whole model where each rank holds only some
of its stages (a pipeline), not rank 0's stages alone."""

from collections.abc import Callable
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count

from project.strategies.laid_out import LaidOutStrategy


class StagesSummary(ModelSummary):
    """``ModelSummary`` whose parameter counts (per layer, total, trainable) are this rank's summed by ``summed``
    over the ranks holding the model's other stages: Lightning counts the parameters the module holds."""

    def __init__(
        self, model: L.LightningModule, max_depth: int, summed: Callable[[dict[str, int]], dict[str, int]]
    ) -> None:
        super().__init__(model, max_depth)
        own = dict(zip((f"layer {name}" for name in self.layer_names), super().param_nums))
        counts = summed({**own, "total": super().total_parameters, "trainable": super().trainable_parameters})
        self._param_nums = [counts[name] for name in own]
        self._total, self._trainable = counts["total"], counts["trainable"]

    @property
    def param_nums(self) -> list[int]:
        return self._param_nums

    @property
    def total_parameters(self) -> int:
        return self._total

    @property
    def trainable_parameters(self) -> int:
        return self._trainable


class WholeModelSummary(RichModelSummary):
    """Lightning's Rich model summary (``max_depth`` levels of modules), its counts the whole model's under every
    strategy: one that lays out the model (``LaidOutStrategy``) sums them over the ranks holding its stages
    (``summed_over_stages``); every rank takes part, rank 0 prints.

    Without Lightning's FLOPs column and total: Lightning counts them only by running a forward pass of the model on
    its ``example_input_array``, which we do not set (a forward of the whole model at fit start, sharded or not), so
    they read 0. The step's model FLOPs are counted on the meta model and logged as ``perf/tflops_per_device``."""

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        # Lightning's Rich table (RichModelSummary.summarize) but for the FLOPs, which it adds unconditionally
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(
                name,
                style="dim" if name == " " else None,
                no_wrap=name == "Name",
                justify="right" if name in ("Params", "Params per Device") else "left",
            )
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        console = get_console()
        console.print(table)
        grid = Table.grid()
        grid.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(trainable_parameters)),
            ("Non-trainable params", get_human_readable_count(total_parameters - trainable_parameters)),
            ("Total params", get_human_readable_count(total_parameters)),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console.print(grid)

    def _summary(self, trainer: L.Trainer, pl_module: L.LightningModule) -> ModelSummary:
        if not isinstance(trainer.strategy, LaidOutStrategy):  # Lightning's own: every rank holds the whole model
            return super()._summary(trainer, pl_module)
        return StagesSummary(pl_module, self._max_depth, trainer.strategy.summed_over_stages)
