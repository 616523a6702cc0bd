"""The GPU nodes a job is planned for (``conf/cluster``): what the memory plan sizes a device by and the step-time
model predicts on."""

import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Annotated, Any, Literal

from project.options.errors import ConfigError
from project.options.option_types import PositiveFloat, PositiveInt, Range

# The host's costs besides its eager ops, each in eager ops' worth of its time (``project.plan.step_time``): a
# kernel a compiled region launches, a call of compiled code, a DTensor an op takes, an FSDP module's hooks in a step,
# and the framework's own work in a step.
HOST_COST_KEYS = ("compiled_kernels", "compiled_calls", "dtensor", "fsdp_modules", "framework_step")

Efficiency = Annotated[float, Range(low=0, high=1, low_open=True)]


@dataclass(frozen=True)
class Cluster:
    """One kind of GPU node (``conf/cluster``), from its datasheets: each GPU's dense BF16 peak in TFLOPS (and FP8
    peak, None for GPUs without float8 tensor cores), memory
    in GB and memory bandwidth in TB/s, its multiprocessors and the exponentials they compute per second (10^12/s:
    softmax's, in attention), the power its peak is rated at and the power limit it
    runs under (W); the GPUs a node joins with NVLink, and the bandwidth each GPU has each way inside a node and to
    other nodes (GB/s). Then the step-time model's efficiencies (``project.plan.step_time``), the same for every
    GPU unless measured on one (``python -m project.cli.calibrate``). The hints are the ranges ``cluster.*`` is
    checked against before launch (``project.config.schema``).

    ``kind``: gpu, or cpu for a CPU that trains itself (``calibrate --cpu``: its cores as one device, its float32
    matmuls as the peak). ``host_op_us``: the host's speed, the microseconds of its time one eager op costs (the
    dispatcher, and on a GPU the launch), measured by ``calibrate``; the host's other costs are multiples of it
    (``project.plan.step_time``), by how many of its eager ops each costs: ``host_costs``, the host's own (keys of
    ``HOST_COSTS`` and ``framework_step``), or None for this project's 2-core CPU machine's (``HOST_COSTS``,
    ``FRAMEWORK_STEP_OPS``). ``collective_latency_us``: each collective's fixed time where it is not NCCL's
    (gloo on a CPU, measured), or None for NCCL's own tuning model."""

    name: str
    kind: Literal["gpu", "cpu"]
    peak_tflops: PositiveFloat
    float8_peak_tflops: PositiveFloat | None
    memory_gb: PositiveFloat
    memory_tb_per_s: PositiveFloat
    multiprocessors: PositiveInt
    exp_tera_per_s: PositiveFloat
    rated_power_w: PositiveFloat
    power_limit_w: PositiveFloat
    devices_per_node: PositiveInt
    intra_node_gb_per_s: PositiveFloat
    inter_node_gb_per_s: PositiveFloat
    matmul_efficiency: Efficiency
    float8_matmul_efficiency: Efficiency
    attention_efficiency: Efficiency
    bandwidth_efficiency: Efficiency
    host_op_us: PositiveFloat
    collective_latency_us: PositiveFloat | None
    host_costs: dict[str, PositiveFloat] | None = None

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> "Cluster":
        """The cluster of a config's ``cluster`` section (its other keys, Hydra's ``defaults``, left out)."""
        given = {field.name: values[field.name] for field in fields(cls)}
        costs = given["host_costs"]
        if costs is not None:
            if set(costs) != set(HOST_COST_KEYS) or not all(_is_positive(costs[key]) for key in costs):
                raise ConfigError(
                    "cluster.host_costs",
                    f"is {dict(costs)}, but it gives each of {', '.join(HOST_COST_KEYS)} in the host's eager ops.",
                    "give each of them a positive number, or null for the 2-core CPU machine's (docs/step-time.md).",
                )
            costs = {key: float(costs[key]) for key in HOST_COST_KEYS}
        return cls(**{**given, "host_costs": costs})


def _is_positive(value: Any) -> bool:
    (positive,) = typing.get_args(PositiveFloat)[1:]  # the option type's own range
    return isinstance(value, (int, float)) and not isinstance(value, bool) and positive.holds(value)
