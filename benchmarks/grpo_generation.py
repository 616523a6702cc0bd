"""GRPO's draws timed against the plan's prediction of them: on this CPU (cluster=cpu_2core), the figures of
docs/finetuning.md ("Planned"); with ``--gpu CLUSTER`` on a CUDA GPU, against that cluster file's prediction
(Qwen 3 0.6B's shape in bf16-mixed, what the page predicts for H100s; not yet run on a GPU).

    python benchmarks/grpo_generation.py
    python benchmarks/grpo_generation.py --gpu h100_sxm_8x   # on one H100 (h200_8x on an H200)

For each case, the job is checked and planned as ``python train.py ... plan=true cluster=cpu_2core`` plans it, and
its step's draws predicted (``predict_step``'s ``generation``, per prompt). Then the same draws run for real: the
model materialised from the seed, in evaluation mode, each prompt's group drawn by ``sample_group`` (what the task
calls) from a prompt of the plan's longest, with no stop token, so every completion runs to its limit as the plan
prices it (on a GPU under bf16 autocast, as ``trainer.precision=bf16-mixed`` runs it). A prompt's draws are timed
with ``time.perf_counter`` (each draw reads its logits on the host: the GPU is synchronised), the median of 5 after
one not counted.
"""

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import cast

import torch
from omegaconf import DictConfig, OmegaConf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from project.cli.chat_example import write_example  # noqa: E402
from project.config.checks import check_config  # noqa: E402
from project.config.composed import composed_train_config  # noqa: E402
from project.models.generation import sample_group  # noqa: E402
from project.parallel.parallelize import materialize  # noqa: E402
from project.plan.memory_plan import plan_memory  # noqa: E402
from project.plan.step_time import predict_step  # noqa: E402

ROUNDS = 5
# Qwen 3 of the example's shape (2 blocks of width 128, heads of 128), and a wider one (4 blocks of 512): the
# first host-bound, the second less so. Their weights drawn from the seed: the time does not depend on them.
CASES = {
    "2 x 128 (the example's)": [
        "model=qwen3",
        "model.net.num_layers=2",
        "model.net.dim=128",
        "model.net.num_heads=2",
        "model.net.num_kv_heads=2",
        "model.net.head_dim=128",
        "model.net.hidden_dim=128",
    ],
    "4 x 512": [
        "model=qwen3",
        "model.net.num_layers=4",
        "model.net.dim=512",
        "model.net.num_heads=8",
        "model.net.num_kv_heads=4",
        "model.net.hidden_dim=1536",
    ],
}
# On a GPU: Qwen 3 0.6B's shape and vocabulary (the example's tokenizer standing in), 64 tokens a completion.
GPU_CASES = {
    "qwen3_0_6b": [
        "model=qwen3_0_6b",
        "model.net.vocab_size=151936",
        "model.grpo.max_completion_length=64",
        "data.seq_length=127",
        "trainer.precision=bf16-mixed",
    ],
}


def case(example: Path, overrides: list[str], cluster: str, device: torch.device) -> tuple[float, float]:
    """A prompt's draws on ``device``: (predicted on ``cluster``, measured) seconds."""
    cfg = composed_train_config(
        [
            "experiment=grpo",
            f"data.tokenizer={example / 'model'}",
            f"data.path={example / 'prompts.jsonl'}",
            f"model.grpo.reward_functions=[{example / 'rewards.py'}:hello]",
            "model.grpo.num_generations=8",
            "model.grpo.max_completion_length=32",
            "data.seq_length=63",
            "data.batch_size=1",
            f"cluster={cluster}",
            *overrides,
        ]
    )
    job = check_config(cast(DictConfig, OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))))
    assert job.cluster is not None and job.generation is not None
    drawn = predict_step(plan_memory(job, suggest=False), job, job.cluster).generation
    assert drawn is not None
    predicted = drawn.seconds / job.batch_size
    net = job.meta_net()
    materialize(net, device, seed=0)
    net.eval()
    prompt = torch.randint(0, 300, (job.generation.prompt_tokens,), device=device)
    on_gpu = device.type == "cuda"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if on_gpu else contextlib.nullcontext()
    times = []
    for _ in range(ROUNDS + 1):
        start = time.perf_counter()
        with autocast:
            sample_group(net, prompt, job.generation.sequences, job.generation.new_tokens, torch.Generator(), {-1})
        times.append(time.perf_counter() - start)
    return predicted, statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", metavar="CLUSTER", help="time on this CUDA GPU against that cluster file's prediction")
    gpu = parser.parse_args().gpu
    cases, cluster, device = (
        (GPU_CASES, gpu, torch.device("cuda")) if gpu else (CASES, "cpu_2core", torch.device("cpu"))
    )
    with tempfile.TemporaryDirectory() as tmp:
        write_example(Path(tmp), count=40)
        print(f"| case ({cluster}) | predicted s a prompt | measured s a prompt | error |")
        print("|---|---|---|---|")
        for name, overrides in cases.items():
            predicted, measured = case(Path(tmp), overrides, cluster, device)
            print(f"| {name} | {predicted:.3f} | {measured:.3f} | {100 * (predicted / measured - 1):+.1f}% |")


if __name__ == "__main__":
    main()
