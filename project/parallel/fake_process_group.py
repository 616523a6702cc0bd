"""torch's fake process-group backend as the default group: meshes and sharding of any size built in this one
process, for the memory plan's simulated ranks and for tests."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed.tensor._redistribute import _gen_transform_infos
from torch.distributed.tensor.debug import _clear_sharding_prop_cache


@contextmanager
def fake_process_group(world_size: int, rank: int) -> Iterator[None]:
    """torch's fake backend as the default process group: collectives return at once with outputs of the right
    shape, so meshes and sharding of any size can be built in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a memory plan needs this process free of a process group")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
        # DTensor caches its sharding decisions, meshes included, keyed by meshes that compare equal whatever the
        # rank and process groups (torch 2.13): the next simulated rank would run its collectives in this one's
        # groups, which are gone.
        _clear_sharding_prop_cache()
        _gen_transform_infos.cache_clear()
