"""What inductor's Triton backend would make of the compiled blocks the plan prices, beside what its CPU backend
makes (``FusedKernels``, which the plan prices): the figures of docs/step-time.md's compiled rows.

    .venv-torch2.11.0/bin/python benchmarks/triton_schedule.py   # about 90 s on 2 busy CPU cores

The plan schedules each compiled block's graphs with inductor's CPU backend, the one every machine has. A GPU's
code is Triton's, which may fuse the same graph otherwise. Scheduling needs no GPU, only Triton (installed with
torch's CUDA wheels, as in the 2.11 venv; not with the CPU wheel): this script plans the rows, and schedules each
block graph again on fake CUDA tensors with the Triton backend, torch's questions about the device answered as an
H100's (``_pretend_h100``: inductor asks for its compute capability and multiprocessors; no kernel is compiled or
run). Torch internals: written against torch 2.11.
"""

import contextlib
import copy
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.device_interface import CudaInterface
from torch._inductor import scheduler as inductor_scheduler
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _triton
from torch.utils._python_dispatch import _disable_current_modes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import FITTED, ROWS, planned  # noqa: E402

from project.plan import compiled_blocks  # noqa: E402

H100 = types.SimpleNamespace(
    name="NVIDIA H100 80GB HBM3",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=80 * 2**30,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    regs_per_multiprocessor=65536,
    warp_size=32,
    shared_memory_per_block_optin=232448,
    L2_cache_size=50 * 2**20,
    gcnArchName="",
)


@contextlib.contextmanager
def _pretend_h100() -> Iterator[None]:
    """Torch's and inductor's questions about the CUDA device answered as an H100's, Triton taken as usable."""

    def properties(*_: Any, **__: Any) -> Any:
        return H100

    patches = [
        (torch.cuda, "get_device_properties", properties),
        (torch.cuda, "get_device_capability", lambda *_, **__: (9, 0)),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "device_count", lambda: 1),
        (CudaInterface, "get_device_properties", staticmethod(properties)),
        (CudaInterface, "get_compute_capability", staticmethod(lambda *_, **__: 90)),
        (CudaInterface.Worker, "get_device_properties", staticmethod(properties)),
        (inductor_scheduler, "has_triton", lambda: True),
        (_triton, "has_triton", lambda: True),
        (fake_tensor, "init_gpu_context", lambda device: None),
    ]
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in patches]
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)


SCHEDULED = compiled_blocks._scheduled  # inductor's scheduler on a graph, for the device of its inputs


def triton_scheduled(graph_module: torch.fx.GraphModule, inputs: list[Any], backward: bool) -> tuple[int, int]:
    """``graph_module`` (a block's graph on CPU fake tensors) traced again on CUDA fake tensors and scheduled by
    inductor's Triton backend: its kernels beside the matmuls and attention (those it generates, and those it leaves
    to ATen), and the bytes they read and write."""
    graph_module = copy.deepcopy(graph_module)
    for node in graph_module.graph.nodes:
        if node.kwargs.get("device") == torch.device("cpu"):
            node.kwargs = {**node.kwargs, "device": torch.device("cuda", 0)}
    graph_module.recompile()
    with _disable_current_modes(), _pretend_h100():
        with FakeTensorMode(allow_non_fake_inputs=True):
            cuda_inputs = [
                torch.empty_strided(item.shape, item.stride(), dtype=item.dtype, device="cuda")
                if isinstance(item, torch.Tensor)
                else item
                for item in inputs
            ]
        traced = make_fx(graph_module, tracing_mode="fake")(*cuda_inputs)
        placeholders = [node.meta["val"] for node in traced.graph.nodes if node.op == "placeholder"]
        kernels = SCHEDULED(traced, placeholders, backward)
    return kernels.kernels, kernels.moved_bytes


def main() -> None:
    print("| row | graph | CPU kernels | CPU GB | Triton kernels | Triton GB | Triton / CPU bytes |")
    print("|---|---|---|---|---|---|---|")
    for row in [*[row for row in FITTED if "compiled" in row.what], *[row for row in ROWS if "compile" in row.what]]:
        seen: list[tuple[bool, Any, tuple[int, int]]] = []

        def both(graph_module: torch.fx.GraphModule, inputs: list[Any], backward: bool) -> Any:
            kernels = SCHEDULED(graph_module, inputs, backward)
            seen.append((backward, kernels, triton_scheduled(graph_module, inputs, backward)))  # noqa: B023
            return kernels

        compiled_blocks._scheduled = both
        for cache in (compiled_blocks._TRACED, compiled_blocks._SCHEDULED):
            cache.clear()
        planned(row)
        for backward, cpu, (kernels, moved) in seen:
            print(
                f"| {row.what} | {'backward' if backward else 'forward'} | {cpu.kernels} | {cpu.moved_bytes / 1e9:.3f}"
                f" | {kernels} | {moved / 1e9:.3f} | {moved / cpu.moved_bytes:.2f} |",
                flush=True,
            )
    compiled_blocks._scheduled = SCHEDULED


if __name__ == "__main__":
    main()
