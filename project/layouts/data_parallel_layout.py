"""``strategy=auto`` and ``strategy=ddp``, Lightning's own strategies: every rank holds the whole model and trains its
share of each global batch; over several ranks, DDP all-reduces the gradients after each backward."""

import math
from collections.abc import Generator, Iterator
from dataclasses import dataclass, replace

from project.accounting.counts import Link
from project.job.job import Change, Job
from project.job.layout import DeviceWork, Layout
from project.models.sequence import BlockSequence
from project.options.errors import ConfigError
from project.parallel.dims import DATA_PARALLEL, ParallelDims

DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's bucket_cap_mb default: an all-reduce per 25 MiB


@dataclass(frozen=True)
class DataParallelLayout(Layout):
    """Every rank a replica of the whole model. ``gradient_as_bucket_view``: DDP's gradients are views of its
    all-reduce buckets (``strategy.gradient_as_bucket_view``; DDP's own default is false)."""

    gradient_as_bucket_view: bool = False

    def processes_per_node(self, devices: int) -> int:
        return devices

    def dims(self, world_size: int) -> ParallelDims:
        return ParallelDims(world_size)

    @property
    def saves_sharded_checkpoints(self) -> bool:
        return False

    def problem(self, job: Job, net: BlockSequence) -> ConfigError | None:
        return None  # Lightning's strategies check their own options when they are built

    def simulated_devices(self, job: Job) -> Generator[DeviceWork, None, None]:
        """One device with the whole model: one device alone, or any rank of DDP (each a replica). DDP's gradients
        live in its all-reduce buckets for the whole run: as views of them (``gradient_as_bucket_view``), or beside
        them, in buckets of the gradients' size."""
        module = job.new_module()
        ddp = job.world_size > 1  # Lightning's auto is DDP over several devices
        views = ddp and self.gradient_as_bucket_view
        gradients = sum(p.numel() * p.element_size() for p in module.net.parameters() if p.requires_grad)
        link = Link("all_reduce", DATA_PARALLEL, job.world_size, job.nodes).key
        yield DeviceWork(
            "rank 0",
            module,
            [module.net],
            job.batch_size,
            grads_persist=views,
            extra_buffer_bytes=gradients if ddp and not views else 0,
            # Every gradient, once a step, over all the job's ranks, node by node, in DDP's buckets.
            unsimulated_collectives={link: gradients} if ddp else {},
            unsimulated_calls={link: math.ceil(gradients / DDP_BUCKET_BYTES)} if ddp else {},
        )

    def blocks_per_device(self, net: BlockSequence) -> list[int]:
        return [len(net.blocks)]

    def bubble_fraction(self) -> float:
        return 0.0

    def memory_saving_changes(self, job: Job) -> Iterator[Change]:
        return iter(())  # the planner's own changes: checkpointing, FSDP, a smaller batch, more devices

    def search_space(self, job: Job, global_batch: int) -> Iterator[Change]:
        """DDP's one layout: every rank a replica."""
        yield Change(replace(job, batch_size=global_batch // job.world_size), frozenset())
