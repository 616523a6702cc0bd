"""How a job's ranks divide: pipeline x data parallel x tensor parallel, torchtitan's order (``ParallelDims``); with
expert parallelism, the data-parallel ranks as groups of ``expert`` ranks that split a mixture's experts.

One object says it and builds the named device mesh; the strategies, the memory plan, the checks and the W&B run
name all read it, so the mesh's dimension names live here alone.

The order of the mesh, outermost first: the stages of a pipeline furthest apart (across nodes, where a pipeline
sends only one stage's activations to the next), then the data-parallel replicas (FSDP's or DDP's collectives),
and a stage's tensor-parallel ranks neighbours (one node, where the links are fastest: they talk in every layer).
"""

import warnings
from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

PIPELINE = "pipeline"
DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
EXPERT = "expert"  # the data-parallel ranks that split a mixture's experts between them, neighbours
EXPERT_SHARD = "expert_shard"  # the data-parallel ranks that hold the same experts (FSDP shards them over these)
# With expert parallelism the data-parallel dimension is two flattened into one, which every layout slices from the
# root mesh by name, as for any other dimension; torch 2.13 supports that and warns that it may not one day.
warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


def divisors(n: int) -> list[int]:
    """The sizes a dimension of ``n`` ranks can take, smallest first."""
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ParallelDims:
    """``world_size`` ranks as ``pipeline`` x data parallel x ``tensor_parallel``; the data-parallel size is what
    is left. ``shard``: the data-parallel ranks shard the model (FSDP) rather than each hold all of it (DDP).
    ``pipelined``: the mesh has a pipeline dimension (strategy=pipeline, even of one rank per pipeline).
    ``expert_parallel``: the data-parallel ranks split a mixture's experts in groups of this many."""

    world_size: int
    pipeline: int = 1
    tensor_parallel: int = 1
    shard: bool = False
    pipelined: bool = False
    expert_parallel: int = 1

    def __post_init__(self) -> None:
        if min(self.world_size, self.pipeline, self.tensor_parallel) < 1:
            raise ValueError(f"every size must be positive: {self}")
        if self.world_size % (self.pipeline * self.tensor_parallel):
            raise ValueError(
                f"{self.world_size} ranks do not divide into pipelines of {self.pipeline} ranks x "
                f"{self.tensor_parallel} tensor-parallel ranks"
            )
        if self.expert_parallel < 1 or self.data_parallel % self.expert_parallel:
            raise ValueError(f"{self.data_parallel} data-parallel ranks do not divide into {self.expert_parallel}s")

    @property
    def data_parallel(self) -> int:
        """Replicas that split each global batch: the ranks of one pipeline and of one tensor-parallel group
        compute one replica's batch together."""
        return self.world_size // (self.pipeline * self.tensor_parallel)

    @property
    def runs_whole_model(self) -> bool:
        """Whether each rank can run the model's forward on its own input (no pipeline stages, no layer split
        over ranks; FSDP gathers each block whole)."""
        return not self.pipelined and self.tensor_parallel == 1

    @property
    def world_dim(self) -> str:
        """The dimension whose groups span every rank, when one does (a mesh reuses the default process group
        for it): the pipeline's, the tensor-parallel one's, else the data-parallel one's (DDP's too)."""
        if self.pipeline == self.world_size > 1:
            return PIPELINE
        if self.tensor_parallel == self.world_size > 1:
            return TENSOR_PARALLEL
        return DATA_PARALLEL

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        data = (EXPERT_SHARD, EXPERT) if self.expert_parallel > 1 else (DATA_PARALLEL,)
        return (PIPELINE, *data, TENSOR_PARALLEL) if self.pipelined else (*data, TENSOR_PARALLEL)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        data = (
            (self.data_parallel // self.expert_parallel, self.expert_parallel)
            if self.expert_parallel > 1
            else (self.data_parallel,)
        )
        return (self.pipeline, *data, self.tensor_parallel) if self.pipelined else (*data, self.tensor_parallel)

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The job's device mesh, its dimensions named; needs the job's process group (a real or a fake one). With
        expert parallelism the data-parallel dimension is the expert shards' and the experts' flattened into one."""
        mesh = init_device_mesh(device_type, self.mesh_shape, mesh_dim_names=self.mesh_dim_names)
        if self.expert_parallel > 1:
            mesh[(EXPERT_SHARD, EXPERT)]._flatten(DATA_PARALLEL)
        return mesh

    def run_name_tag(self) -> str:
        """What a W&B run's name says of the layout beyond the strategy: ``-tp<N>`` when N ranks split each layer,
        so that runs of one strategy with and without tensor parallelism are told apart."""
        return f"-tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
