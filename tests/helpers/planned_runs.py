"""The runs of the GPU memory-plan test (``tests/test_gpu.py``), which ``benchmarks/memory_plan.py gpu`` plans
again on the CPU against the peaks those runs measured (docs/gpu.md)."""

# Presets (and a mixture of experts) at sequence 1024, bf16-mixed, a few steps each. The models get their own
# vocabularies (GPT-2's, padded to 64; Llama 3's); the Markov language's stays small, since its generator holds a
# dense vocab x vocab matrix, and the embedding, output layer and loss cost the same whichever ids occur.
PLANNED_MODELS = {  # preset: (its overrides, sequences per step)
    "gpt_125m": (["model=gpt_125m", "model.net.vocab_size=50304"], 8),
    "gpt_350m": (["model=gpt_350m", "model.net.vocab_size=50304"], 8),
    "llama_1b": (["model=llama_1b", "model.net.vocab_size=128256"], 4),
    # Qwen 3 MoE's kind at 0.7 B: 8 blocks of 32 experts, 4 a token (16,384 rows a block, grouped matmuls in bf16)
    "moe_0_7b": (
        ["model=moe", "model.net.vocab_size=128256", "model.net.num_layers=8", "model.net.dim=1024"]
        + ["model.net.num_heads=16", "model.net.num_kv_heads=4", "model.net.num_experts=32"]
        + ["model.net.experts_per_token=4", "model.net.expert_hidden_dim=512"],
        4,
    ),
}
STEPS = 3


def planned_run(model: str, strategy: str, activation_checkpointing: str) -> list[str]:
    """The overrides of one such run (``trainer.accelerator`` and the logger are the caller's)."""
    overrides, batch = PLANNED_MODELS[model]
    return [
        "data=tokens",
        "data.vocab_size=256",
        *overrides,
        f"data.batch_size={batch}",
        f"strategy={strategy}",
        "trainer.precision=bf16-mixed",
        "data.seq_length=1024",
        f"data.num_train={STEPS * batch}",
        f"data.num_val={batch}",
        "trainer.max_epochs=1",
        "trainer.num_sanity_val_steps=0",
        f"model.activation_checkpointing={activation_checkpointing}",
        "~callbacks.model_checkpoint",
        "+trainer.enable_checkpointing=false",  # no 20 GB of checkpoint writing
        "print_config=false",
        "~callbacks.progress_bar",
        "+trainer.enable_progress_bar=false",
    ]
