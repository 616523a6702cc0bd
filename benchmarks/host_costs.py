"""The host's costs on this CPU, for the step-time model's host term: ``python benchmarks/host_costs.py``.

The model (``project/plan/step_time.py``) prices the host's time of a step as the ops it dispatches eagerly, at
the cluster's ``host_op_us``, plus other costs in eager ops' worth (``HOST_COSTS``). Each is measured here, in one
process with one thread, on steps so small that their time is the host's: the tiny GPT (``model=gpt``, 2 blocks
of width 16: their arithmetic next to nothing) at 2 sequences of 16 tokens, fused AdamW, written as a plain loop;
the ops counted by the model's own counter (``StepCounts``) on a step of the same code.

- an eager op: the eager step's time over its ops (``calibrate``'s ``measure_host``, which sets a cluster's
  ``host_op_us``);
- a compiled kernel: a compiled function of 8 matmuls each followed by an elementwise kernel, less one of a single
  elementwise kernel, over the 15 kernels between them (forward only);
- a call of compiled code (a block's forward or backward, with AOTAutograd's wrappers): the tiny GPT's step with
  its 2 blocks compiled, less its eager ops and its blocks' kernels, over its 4 calls;
- a DTensor an op takes: the optimizer's step over a world-1 FSDP model's DTensor parameters, less the same step
  over plain ones, less its extra eager ops, over the DTensors its ops took;
- an FSDP module's hooks: the world-1 FSDP step less the plain one, less its extra eager ops and DTensors, over its
  FSDP modules.

Then the compiled tiny GPT at 6 blocks is predicted from them and measured: a check, not fitted. Three rounds;
printed: the eager op in microseconds, each other cost in eager ops, each round's and their median.
"""

import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from project.accounting.counts import StepCounts  # noqa: E402
from project.cli.calibrate import measure_host  # noqa: E402
from project.models import GPT, init_weights  # noqa: E402
from project.parallel.parallelize import apply_fsdp, compile_blocks  # noqa: E402
from project.plan.step_time import HOST_COSTS  # noqa: E402

BATCH, SEQ, VOCAB = 2, 16, 64
torch.set_num_threads(1)


def seconds(run: Callable[[], object], repeats: int = 200) -> float:
    """Median seconds of ``run`` over ``repeats`` calls in 5 rounds, after 20 calls of warm-up."""
    for _ in range(20):
        run()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        rounds.append((time.perf_counter() - start) / repeats)
    return statistics.median(rounds)


def tiny_gpt(blocks: int = 2) -> GPT:
    return init_weights(GPT(vocab_size=VOCAB, max_length=SEQ, num_layers=blocks, dim=16, num_heads=4), 0)


def training_step(net: nn.Module, loss_of: Callable, optimizer: torch.optim.Optimizer) -> Callable[[], None]:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))

    def step() -> None:
        logits = net(tokens)
        loss_of(logits.reshape(-1, VOCAB), tokens.reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def counted(run: Callable[[], object], net: nn.Module | None = None, compiled: bool = False) -> StepCounts:
    """The host's ops of one call of ``run``, as the simulation counts them (a compiled net's blocks and loss
    counted as compiled: the simulation's own hooks)."""
    from project.plan.simulate import _fused_in_compiled

    counts = StepCounts(devices_per_node=1, world_dim="world")

    class Loss:  # the simulation asks the task for its compiled loss module: none here (the loss is a function)
        def compiled_loss_module(self) -> None:
            return None

    run()  # a first call makes the optimizer's state: counted from the second, as the simulation counts
    with _fused_in_compiled(net, Loss(), counts) if compiled else nullcontext(), counts:  # type: ignore[arg-type]
        run()
    return counts


def compiled_kernel() -> float:
    """Seconds of a kernel launched from compiled code, from two compiled functions."""
    x = torch.randn(8, 32)
    weights = [torch.randn(32, 32) for _ in range(8)]

    def one_kernel(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    def many_kernels(x: torch.Tensor) -> torch.Tensor:
        for weight in weights:
            x = torch.tanh(x @ weight) * 0.5
        return x

    one, many = torch.compile(one_kernel), torch.compile(many_kernels)
    with torch.no_grad():
        return (seconds(lambda: many(x)) - seconds(lambda: one(x))) / (2 * len(weights) - 1)


def compiled_step(blocks: int) -> tuple[float, Counter]:
    """Seconds of the tiny GPT's step with ``blocks`` blocks compiled, and its host ops as the simulation counts
    them (an eager twin, its blocks' ops marked as compiled)."""
    net, twin = tiny_gpt(blocks), tiny_gpt(blocks)
    compile_blocks(net)
    measured = seconds(training_step(net, nn.functional.cross_entropy, torch.optim.AdamW(net.parameters(), fused=True)))
    step = training_step(twin, nn.functional.cross_entropy, torch.optim.AdamW(twin.parameters(), fused=True))
    return measured, counted(step, twin, compiled=True).host_ops


def fsdp_costs(op: float) -> tuple[float, float]:
    """Seconds of an op DTensor dispatches and of an FSDP module's hooks a step, at world size 1."""
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    plain, sharded = tiny_gpt(), tiny_gpt()
    apply_fsdp(sharded, mesh)
    times, counts, optimizer_times, optimizer_counts = {}, {}, {}, {}
    for name, net in (("plain", plain), ("fsdp", sharded)):
        optimizer = torch.optim.AdamW(net.parameters(), fused=True)
        step = training_step(net, nn.functional.cross_entropy, optimizer)
        times[name], counts[name] = seconds(step), counted(step).host_ops
        for parameter in net.parameters():
            parameter.grad = torch.zeros_like(parameter)
        optimizer_times[name] = seconds(optimizer.step)
        optimizer_counts[name] = counted(optimizer.step).host_ops
    dist.destroy_process_group()
    dtensors = optimizer_counts["fsdp"]["dtensor"]
    extra_eager = optimizer_counts["fsdp"]["eager"] - optimizer_counts["plain"]["eager"]
    dtensor = (optimizer_times["fsdp"] - optimizer_times["plain"] - extra_eager * op) / dtensors
    modules = sum(isinstance(module, FSDPModule) for module in sharded.modules())
    extra = times["fsdp"] - times["plain"]
    extra -= (counts["fsdp"]["eager"] - counts["plain"]["eager"]) * op + counts["fsdp"]["dtensor"] * dtensor
    return dtensor, extra / modules


def measure() -> dict[str, float]:
    """One round of every measurement: the eager op's seconds, and each other cost in eager ops."""
    op = measure_host("cpu")[0] * 1e-6  # calibrate's: its tiny GPT's step over its eager ops
    kernel = compiled_kernel()
    two, ops = compiled_step(2)
    # The blocks' calls: the step less its eager ops and its blocks' kernels, over the calls
    call = (two - ops["eager"] * op - ops["compiled_kernels"] * kernel) / ops["compiled_calls"]
    dtensor, module = fsdp_costs(op)
    costs = {"compiled_calls": call, "compiled_kernels": kernel, "dtensor": dtensor, "fsdp_modules": module}
    six, six_ops = compiled_step(6)
    predicted = six_ops["eager"] * op + six_ops["compiled_calls"] * call + six_ops["compiled_kernels"] * kernel
    return {"host_op_us": op * 1e6, **{name: cost / op for name, cost in costs.items()}, "check": predicted / six - 1}


def main() -> None:
    print(f"torch {torch.__version__}, 1 thread, load average {os.getloadavg()[0]:.2f}; 3 rounds")
    rounds = [measure() for _ in range(3)]
    print("| cost | eager ops (rounds) | median | HOST_COSTS now |")
    print("|---|---|---|---|")
    for name in ["host_op_us", *HOST_COSTS]:
        values = [round(one[name], 2) for one in rounds]
        now = HOST_COSTS.get(name, "(us)")
        print(f"| {name} | {values} | {statistics.median(values):.2f} | {now} |")
    checks = ", ".join(f"{one['check']:+.1%}" for one in rounds)
    print(f"check: the compiled tiny GPT at 6 blocks, predicted against measured: {checks}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
