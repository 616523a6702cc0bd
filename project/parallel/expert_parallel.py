"""Expert parallelism (``apply_expert_parallel``): a mixture's routed experts split over the ranks of an ``expert``
mesh dimension, each holding ``num_experts / size`` of them, as torchtitan's ``ExpertParallel`` splits its
``GroupedExperts``.

Every rank routes its own tokens (the router and the rest of the block are data parallel). The rows sorted by
expert go to the ranks holding their experts in one all-to-all, the counts of each expert's rows in another before
it (each rank learns how many rows it receives from each rank for each of its experts); each rank runs its experts
once on the rows of all ranks, and a last all-to-all brings every row's output back to the rank that routed it,
in its original order. Autograd runs the same exchanges backward (torch's ``all_to_all_single_autograd``).

So an expert's gradient on its rank sums the contributions of the ``size`` ranks' tokens, where data parallelism
averages every other gradient over the ranks. FSDP shards the experts again over the data-parallel ranks that hold
the same ones (``project.parallel.parallelize.apply_fsdp``) and divides their reduced gradient by those ranks; the
experts' weights enter the forward with their gradient scaled by 1 / ``size`` (``_GradientScale``), so that the
division is by all the data-parallel ranks, as every other gradient's. (FSDP's own ``set_gradient_divide_factor``
would do it in the reduction, with a reduce op gloo lacks.)
"""

import warnings
from typing import Any

import torch
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from project.models.moe import ExpertMLPs, Experts, holds_values, mixtures, swiglu_experts
from project.models.sequence import BlockSequence
from project.parallel.dims import divisors
from project.parallel.local_tensors import local_tensor

# FSDP warns that the experts' output is a view (the last all-to-all's), on which an in-place op would skip its
# pre-backward hook; ``Experts.forward`` only multiplies it, out of place.
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPExpertParallelMLPs\) returned a view tensor")


class ExpertParallelMLPs(ExpertMLPs):
    """``ExpertMLPs`` whose stacked weights are split by experts over ``mesh`` (DTensors, ``Shard(0)``), and whose
    forward sends rows to the ranks holding their experts and their outputs back."""

    def __init__(self, plain: ExpertMLPs, mesh: DeviceMesh) -> None:
        nn.Module.__init__(self)
        self.mesh = mesh
        for name, parameter in plain.named_parameters():
            split = distribute_tensor(parameter.detach(), mesh, [Shard(0)], src_data_rank=None)
            self.register_parameter(name, nn.Parameter(split, requires_grad=parameter.requires_grad))

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` sorted by expert, ``counts[e]`` of them expert e's (every expert's, this rank's tokens):
        their outputs, in the same order."""
        size, rank = self.mesh.size(), self.mesh.get_local_rank()
        local = len(counts) // size  # experts a rank holds
        group = self.mesh.get_group()
        # received_counts[i][l]: rows rank i sends for this rank's expert l.
        sent = torch.tensor(counts, dtype=torch.long, device=rows.device)
        received = all_to_all_single(sent, [local] * size, [local] * size, group).view(size, local)
        if holds_values(received):
            received_counts = received.tolist()
        else:  # shapes alone (the memory plan): every rank routes as evenly as this one
            received_counts = [counts[rank * local : (rank + 1) * local]] * size
        send_sizes = [sum(counts[i * local : (i + 1) * local]) for i in range(size)]
        receive_sizes = [sum(row) for row in received_counts]
        arrived = all_to_all_single_autograd(rows, receive_sizes, send_sizes, group)
        # Arrived by source rank, then by expert within it: regroup by expert, each expert's rows once.
        starts, offset = [], 0
        for row in received_counts:
            starts.append([offset + sum(row[:expert]) for expert in range(local)])
            offset += sum(row)
        by_expert = torch.cat(
            [
                torch.arange(starts[source][expert], starts[source][expert] + received_counts[source][expert])
                for expert in range(local)
                for source in range(size)
            ]
        ).to(rows.device)
        expert_counts = [sum(received_counts[source][expert] for source in range(size)) for expert in range(local)]
        gate, up, down = (
            _GradientScale.apply(local_tensor(weight), 1 / size) for weight in (self.gate, self.up, self.down)
        )
        outputs = swiglu_experts(arrived[by_expert], expert_counts, gate, up, down)
        in_arrival_order = torch.empty_like(outputs).index_copy(0, by_expert, outputs)
        return all_to_all_single_autograd(in_arrival_order, send_sizes, receive_sizes, group)


class _GradientScale(torch.autograd.Function):
    """The identity forward; backward, the gradient times ``scale``."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


def apply_expert_parallel(model: BlockSequence, mesh: DeviceMesh) -> None:
    """Split every mixture's routed experts of ``model`` (on the meta device) over ``mesh``."""
    for module in model.modules():
        if isinstance(module, Experts) and not isinstance(module.experts, ExpertParallelMLPs):
            module.experts = ExpertParallelMLPs(module.experts, mesh)


def expert_parallel_sizes(experts: list[int], replicas: int, devices_per_node: int) -> list[int]:
    """The expert-parallel sizes a search tries (1 alone without a mixture): those within a node that divide the
    experts (``experts``: each mixture's, ``expert_counts``) and the ``replicas`` data-parallel ranks."""
    if not experts:
        return [1]
    return [size for size in divisors(devices_per_node) if replicas % size == 0 and experts[0] % size == 0]


def expert_counts(model: nn.Module) -> list[int]:
    """The number of routed experts of each mixture of ``model``."""
    return [mixture.num_experts for mixture in mixtures(model).values()]
