"""perf/tflops_per_device and perf/mfu: the FLOP count against the published formulas, the peaks table, and the
logged values of real runs against the arithmetic done here."""

import pytest
import torch
from conftest import TINY, TINY_GPT, TINY_LLAMA, only_run
from test_config import compose_train
from torch import nn

from project.config.build import build_net
from project.observability.flops import peak_tflops, training_flops_per_sample

pytestmark = pytest.mark.torch_internals


def meta_net(overrides: list[str]) -> nn.Module:
    return build_net(compose_train(overrides))  # the model on the meta device, as a run builds it


TRANSFORMERS = {"gpt": TINY_GPT, "llama": TINY_LLAMA}  # width 32 in 2 heads; the Llama's share 1 key/value head


def transformer_formula(net: nn.Module, length: int) -> int:
    """nanoGPT's (and PaLM's) training FLOPs per token, times the tokens of a sample: 6N for the matmul weights N
    (every Linear layer, the output layer included; embeddings are lookups), plus 12·L·H·Q·T for attention's two
    matmuls (L layers, H query heads of width Q: H·Q is the model width; T tokens of context)."""
    weights = sum(module.weight.numel() for module in net.modules() if isinstance(module, nn.Linear))
    width = net.blocks[0].norm1.weight.shape[0]
    return length * (6 * weights + 12 * len(net.blocks) * width * length)


@pytest.mark.parametrize("model", TRANSFORMERS)
def test_a_transformer_counts_the_published_formula(model):
    overrides = TRANSFORMERS[model]
    net = meta_net(overrides)
    length = 16  # data.seq_length of the tiny presets
    assert training_flops_per_sample(net, torch.zeros(8, length, dtype=torch.long)) == transformer_formula(net, length)
    assert all(parameter.is_meta and parameter.grad is None for parameter in net.parameters())  # untouched


def test_the_mlp_counts_each_matmul_of_forward_and_backward():
    """2 FLOPs per multiply-add: forward x·W, backward dW for every layer and dx for all but the first (the data
    needs no gradient)."""
    net = meta_net(TINY[:4])  # 32 features -> 64 -> 32 -> 10 classes
    sizes = [(32, 64), (64, 32), (32, 10)]
    expected = sum(2 * i * o for i, o in sizes) * 2 + sum(2 * i * o for i, o in sizes[1:])
    assert training_flops_per_sample(net, torch.zeros(8, 32)) == expected


def test_peaks_are_the_dense_datasheet_figures_for_the_runs_precision():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16-mixed", tf32=True) == 989.5
    assert peak_tflops("NVIDIA H100 80GB HBM3", "32-true", tf32=True) == 494.5
    assert peak_tflops("NVIDIA H100 80GB HBM3", "32-true", tf32=False) == 67.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16-mixed", tf32=True) == 756.5
    assert peak_tflops("NVIDIA H200", "16-mixed", tf32=True) == 989.5
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "bf16-mixed", tf32=True) == 312.0
    assert peak_tflops("NVIDIA L40S", "bf16-mixed", tf32=True) == 362.05  # not the L4's
    assert peak_tflops("NVIDIA L4", "bf16-mixed", tf32=True) == 121.0
    assert peak_tflops("NVIDIA A10G", "bf16-mixed", tf32=True) is None  # no datasheet: no MFU rather than a guess
    assert peak_tflops("NVIDIA GeForce RTX 4090", "bf16-mixed", tf32=True) is None


@pytest.mark.slow
@pytest.mark.parametrize(
    "fixture, job, overrides, ranks",
    [
        ("gpt_auto", None, TINY_GPT, 1),
        ("gpt_ddp_fsdp_sweep", 0, TINY_GPT, 2),  # two replicas
        ("llama_split_sweep", 1, TINY_LLAMA, 2),  # one replica of two pipeline stages
    ],
)
def test_logged_tflops_are_the_jobs_model_flops_per_second_per_device(fixture, job, overrides, ranks, request):
    job_dir = request.getfixturevalue(fixture)
    run = only_run(job_dir if job is None else job_dir[job])
    per_sample = transformer_formula(meta_net(overrides), 16)
    samples_per_sec, tflops = run.series("perf/samples_per_sec"), run.series("perf/tflops_per_device")
    assert len(tflops) == 3
    for rate, logged in zip(samples_per_sec, tflops):
        assert logged == pytest.approx(per_sample * rate / ranks / 1e12, rel=1e-5)
    assert "perf/mfu" not in run.history[-1]  # CPU: no peak to divide by
