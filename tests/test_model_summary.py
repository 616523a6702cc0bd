"""The model summary (``project/observability/model_summary.py``): Lightning's Rich table, its FLOPs column left out
(Lightning fills it only from a forward pass on ``example_input_array``, which the tasks do not set)."""

import lightning as L
from lightning.pytorch.utilities.model_summary import ModelSummary
from rich import get_console
from torch import nn

from project.observability import WholeModelSummary


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)


def test_the_table_has_lightnings_columns_but_flops_and_its_totals_but_flops():
    """Column by column as Lightning lists them (so that a Lightning release that adds or renames one shows here),
    and the totals' lines."""
    summary = ModelSummary(Tiny(), max_depth=1)
    data = summary._get_summary_data()
    with get_console().capture() as captured:
        WholeModelSummary.summarize(
            data,
            summary.total_parameters,
            summary.trainable_parameters,
            summary.model_size,
            summary.total_training_modes,
            summary.total_flops,
        )
    lines = captured.get().splitlines()
    header = next(line for line in lines if "Name" in line)
    assert [cell.strip() for cell in header.strip("┃").split("┃")] == [
        name.strip() for name, _ in data if name != "FLOPs"
    ]
    assert [line.split(":")[0] for line in lines if ":" in line] == [
        "Trainable params",
        "Non-trainable params",
        "Total params",
        "Total estimated model params size (MB)",
        "Modules in train mode",
        "Modules in eval mode",
    ]
    assert "FLOPs" not in captured.get() and "Total params: 23" in captured.get()
