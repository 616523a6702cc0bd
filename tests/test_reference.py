"""Every strategy against the hand-written loop of ``reference.py``: the same per-epoch numbers to 1e-5, for the MLP
and for the tiny GPT and Llama (AdamW with weight-decay groups, warmup + cosine over the run's steps), shuffled every
epoch; the tensor-parallel layouts too (tensor parallel alone, under FSDP, inside pipeline stages).

The runs are the session's real ``python train.py`` runs (conftest); the reference trains in this process.
"""

import pytest
from conftest import (
    FIRST_EPOCH,
    GPT_FUSED,
    GPT_LORA,
    MOE_BALANCED,
    MOE_BIASED,
    MOE_SGD,
    QLORA,
    TINY,
    TINY_GPT,
    TINY_LLAMA,
    TINY_LLAMA_NF4,
    TINY_LLAMA_TP,
    TINY_MOE,
    TINY_QWEN,
    assert_matches_reference,
    only_run,
)

# (fixture, job index or None) of each strategy's run; every one has the reference's global batch.
RUNS = {
    "mlp": {
        "auto": ("single_run", None),
        "ddp": ("ddp_fsdp_sweep", 0),
        "fsdp": ("ddp_fsdp_sweep", 1),
        "model_parallel": ("model_parallel_run", None),
        "pipeline-gpipe": ("pipeline_sweep", 0),
        "pipeline-1f1b": ("pipeline_sweep", 1),
        "tensor_parallel": ("mlp_tensor_parallel", None),
    },
    "gpt": {  # the pipeline schedules against each other: the MLP's runs. The pipeline compiles the blocks
        # (model.compile=true): compiled against the eager reference.
        "auto": ("gpt_auto", None),
        "ddp": ("gpt_ddp_fsdp_sweep", 0),
        "fsdp": ("gpt_ddp_fsdp_sweep", 1),
        "fsdp-selective-checkpointing": ("gpt_fsdp_selective", None),
        "pipeline-selective-checkpointing": ("gpt_split_selective_sweep", 0),
        "tensor_parallel-selective-checkpointing": ("gpt_split_selective_sweep", 1),
        "pipeline-1f1b-compiled": ("gpt_pipeline_compiled", None),
        "tensor_parallel": ("gpt_tensor_parallel", None),
        "fsdp-x-tensor_parallel": ("gpt_fsdp_tensor_parallel", None),
        "pipeline-x-tensor_parallel": ("gpt_pipeline_tensor_parallel", None),
    },
    "gpt-fused": {  # model.fused_loss: the output layer and the loss in chunks, against the loop's whole logits
        "ddp": ("gpt_fused_sweep", 0),
        "fsdp": ("gpt_fused_sweep", 1),
        "model_parallel": ("gpt_fused_model_parallel", None),
    },
    "llama": {  # ddp: the GPT's and the MLP's
        "auto": ("llama_auto", None),
        "fsdp": ("llama_fsdp", None),
        "model_parallel": ("llama_split_sweep", 0),
        "pipeline-1f1b": ("llama_split_sweep", 1),
    },
    "llama-tp": {  # 2 key/value heads, which 2 tensor-parallel ranks can split
        "tensor_parallel": ("llama_tensor_parallel", None),
        "tensor_parallel-compiled": ("llama_tensor_parallel_compiled", None),
    },
    "qwen2-tp": {"tensor_parallel": ("qwen2_tensor_parallel", None)},  # its biases split by heads
    "qwen3-tp": {"tensor_parallel": ("qwen3_tensor_parallel", None)},  # its norms on each rank's heads
    "gpt-lora": {  # the reference's adapters are peft's
        "auto": ("gpt_lora_auto", None),
        "ddp": ("gpt_lora_ddp", None),
        "fsdp": ("gpt_lora_fsdp", None),
        "pipeline": ("gpt_lora_pipeline", None),
        "tensor_parallel": ("gpt_lora_tensor_parallel", None),  # lora_b split with the base's outputs
        "fsdp-x-tensor_parallel": ("gpt_lora_fsdp_tensor_parallel", None),  # resumed from the adapters of epoch 0
        "pipeline-x-tensor_parallel": ("gpt_lora_pipeline_tensor_parallel", None),  # ... of epoch 1
    },
    "llama-qlora": {  # the reference's base: torchao's NF4 round trip of the seeded weights, in float32
        "auto": ("llama_qlora_auto", None),  # with selective activation checkpointing
        "ddp": ("llama_qlora_sweep", 0),
        "fsdp": ("llama_qlora_sweep", 1),  # the larger weights sharded in 4 bits, k and v whole on each rank
    },
    "llama-qlora-16": {"pipeline": ("llama_qlora_sweep", 2)},  # one replica of 16
    "moe-capped": {"auto": ("moe_auto", None)},  # sigmoid scores; half of each expert's assignments dropped
    "moe-balanced": {"auto": ("moe_balanced", None)},  # top 2 of 4, a balance loss in the training loss
    "moe-biased": {"ddp": ("moe_biased", None)},  # top 2 of 4, DeepSeek-V3's score bias
    "moe": {"ddp": ("moe_sweep", 0), "fsdp": ("moe_sweep", 1)},
    "moe-16": {"pipeline": ("moe_sweep", 2)},
    "moe-sgd": {"fsdp2-ep2": ("moe_expert_parallel", 1)},  # experts split over 2 ranks, sharded over 2 more
    "moe-sgd-16-capped": {"ep2": ("moe_expert_parallel_capped", None)},  # half of each rank's assignments dropped
    "moe-sgd-16": {
        "ep2": ("moe_expert_parallel", 0),
        "pipeline2-x-ep2": ("moe_pipeline_expert_parallel", None),  # each stage's experts split over 2 replicas
    },
}
REFERENCE_ARGS = {
    "mlp": ([*TINY, "data.batch_size=64"], 64),
    "gpt": ([*TINY_GPT, "data.batch_size=32"], 32),
    "gpt-fused": ([*GPT_FUSED, "data.batch_size=32"], 32),
    "llama": ([*TINY_LLAMA, "data.batch_size=32"], 32),
    "llama-tp": ([*TINY_LLAMA_TP, "data.batch_size=32"], 32),
    "gpt-lora": ([*TINY_GPT, "data.batch_size=32", GPT_LORA], 32),
    "llama-qlora": ([*TINY_LLAMA_NF4, "data.batch_size=32", QLORA], 32),
    "llama-qlora-16": ([*TINY_LLAMA_NF4, "data.batch_size=16", QLORA], 16),
    "moe-capped": (
        [*TINY_MOE, "data.batch_size=32", "model.net.router_scores=sigmoid", "model.net.capacity_factor=0.5"],
        32,
    ),
    "moe-balanced": (MOE_BALANCED, 32),
    "moe-biased": ([*MOE_BIASED, "data.batch_size=16"], 32),
    "moe": ([*TINY_MOE, "data.batch_size=16"], 32),
    "moe-16": ([*TINY_MOE, "data.batch_size=16"], 16),
    "moe-sgd": ([*MOE_SGD, "data.batch_size=8"], 32),
    "moe-sgd-16": ([*MOE_SGD, "data.batch_size=8"], 16),
    # the loop's forwards are the 2 ranks' slices: a capacity drops of the tokens each forward routes
    "moe-sgd-16-capped": ([*MOE_SGD, "data.batch_size=8", "model.net.capacity_factor=0.5"], 16, 2),
    "qwen2-tp": (["model=qwen2", *TINY_QWEN, "data.batch_size=32"], 32),
    "qwen3-tp": (["model=qwen3", *TINY_QWEN, "data.batch_size=32"], 32),
}


# Runs whose code leans on torch's internals (compile_blocks' wait for a pending collective): on 2.11 too.
ON_TORCH_INTERNALS = {("llama-tp", "tensor_parallel-compiled")}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model, strategy",
    [
        pytest.param(model, strategy, marks=[pytest.mark.torch_internals] * ((model, strategy) in ON_TORCH_INTERNALS))
        for model in RUNS
        for strategy in RUNS[model]
    ],
)
def test_every_strategy_matches_the_hand_written_loop(model, strategy, reference, request):
    fixture, job = RUNS[model][strategy]
    job_dir = request.getfixturevalue(fixture)
    run = only_run(job_dir if job is None else job_dir[job])
    overrides, global_batch, *forwards = REFERENCE_ARGS[model]
    history = reference(overrides, global_batch, forwards=forwards[0] if forwards else 1).history
    assert len(history) == 3  # at least three epochs, each in its own shuffled order
    if strategy != "auto":
        # A mixture's balance loss is not a sum over tokens: each rank's (or micro-batch's) forward has its own, of
        # its part of the batch, where the loop's forward sees the whole batch. Its counts are sums: still compared.
        history = [{key: value for key, value in row.items() if key != "experts/balance_loss"} for row in history]
    epochs = 1 if fixture in ("moe_balanced", "moe_biased") else None  # top-2 routing: see MOE_BALANCED
    assert_matches_reference(run, history[FIRST_EPOCH.get(fixture, 0) :], epochs=epochs)  # 4-device layouts resume
