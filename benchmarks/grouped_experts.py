"""The routed experts of one mixture layer, forward and backward, as three grouped matmuls (``torch._grouped_mm``)
against a loop over the experts: ``python benchmarks/grouped_experts.py [--out DIR] [--shape NAME]``.

Shapes: ``qwen3_30b_a3b`` (the default: 128 experts of width 2048 -> 768, 8 of them per token, a batch of 8 x 2048
tokens, 131,072 rows) and ``mixtral_8x7b`` (8 experts of 4096 -> 14336, 2 per token, 4 x 2048 tokens), in bfloat16
on the GPU; ``tiny`` (8 experts of 64 -> 32, 2 per token, 256 tokens) runs on the CPU in seconds, to check the code.
The rows each expert gets are drawn as a router would send them (each token to ``experts_per_token`` experts
chosen at random, so the counts vary), the same for both ways. Timed with CUDA events over ``--steps`` steps after
``--warmup`` (the CPU: a monotonic clock); TFLOP/s counts 3 matmuls of 2 x rows x dim x hidden, 3 times (forward
and two gradients). Also the two ways' largest output difference relative to the largest output, against the
same experts in float32. Prints a table and, with ``--out``, writes ``grouped_experts.{md,json}`` there.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from project.models.moe import grouped_swiglu_experts, looped_swiglu_experts

SHAPES = {  # experts, experts per token, dim, expert hidden, tokens
    "qwen3_30b_a3b": (128, 8, 2048, 768, 8 * 2048),
    "mixtral_8x7b": (8, 2, 4096, 14336, 4 * 2048),
    "tiny": (8, 2, 64, 32, 256),
}


def routed_counts(experts: int, per_token: int, tokens: int, generator: torch.Generator) -> list[int]:
    """Each token's ``per_token`` distinct experts drawn at random: how many rows each expert gets."""
    chosen = torch.rand(tokens, experts, generator=generator).topk(per_token, dim=-1).indices
    return torch.bincount(chosen.reshape(-1), minlength=experts).tolist()


def timed(step, steps: int, warmup: int, device: torch.device) -> float:
    """Seconds a call of ``step`` takes, the mean of ``steps`` after ``warmup``."""
    for _ in range(warmup):
        step()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            step()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1000 / steps
    began = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - began) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3_30b_a3b")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    experts, per_token, dim, hidden, tokens = SHAPES[args.shape]
    generator = torch.Generator().manual_seed(0)
    counts = routed_counts(experts, per_token, tokens, generator)
    rows = torch.randn(sum(counts), dim, generator=generator).to(device, torch.bfloat16).requires_grad_()
    scale = dim**-0.5
    weights = [
        (torch.randn(shape, generator=generator) * scale).to(device, torch.bfloat16).requires_grad_()
        for shape in ((experts, hidden, dim), (experts, hidden, dim), (experts, dim, hidden))
    ]
    cotangent = torch.randn(sum(counts), dim, generator=generator).to(device, torch.bfloat16)
    ways = {"grouped": grouped_swiglu_experts, "loop": looped_swiglu_experts}

    def step(way):
        def run() -> None:
            ways[way](rows, counts, *weights).backward(cotangent)

        return run

    with torch.no_grad():
        exact = looped_swiglu_experts(rows.float(), counts, *(weight.float() for weight in weights))
        errors = {
            way: ((function(rows, counts, *weights).float() - exact).abs().max() / exact.abs().max()).item()
            for way, function in ways.items()
        }
    flops = 3 * 3 * 2 * sum(counts) * dim * hidden
    results = {}
    for way in ways:
        seconds = timed(step(way), args.steps, args.warmup, device)
        results[way] = {"ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "relative_error": errors[way]}
    speedup = results["loop"]["ms"] / results["grouped"]["ms"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    lines = [
        f"{args.shape}: {experts} experts, {per_token} per token, {dim} -> {hidden}, {tokens} tokens "
        f"({sum(counts)} rows, {min(counts)} to {max(counts)} an expert), bf16, {name}, torch {torch.__version__}",
        "",
        "| experts as | ms, forward + backward | TFLOP/s | largest error / largest output (vs float32) |",
        "|---|---|---|---|",
        *(f"| {way} | {r['ms']:.2f} | {r['tflops']:.1f} | {r['relative_error']:.2e} |" for way, r in results.items()),
        "",
        f"grouped: {speedup:.2f}x the loop's speed",
    ]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "grouped_experts.md").write_text("\n".join(lines) + "\n")
        record = {"shape": args.shape, "device": name, "torch": torch.__version__, "counts": counts, **results}
        (args.out / "grouped_experts.json").write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
