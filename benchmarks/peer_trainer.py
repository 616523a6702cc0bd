"""A peer trainer's step beside ours: transformers' ``Trainer`` (the loop TRL runs on, installed on the GPU boxes)
training Llama-3.2-1B's shape from scratch on random tokens, as ``benchmarks/gpu.py``'s llama_1b case trains ours:
batch 8 x 1024, bf16 mixed precision, fused AdamW, SDPA attention, no checkpoints, eager or compiled.

    python benchmarks/peer_trainer.py --out peer.json [--compile] [--steps 30]
    python benchmarks/peer_trainer.py --tiny --steps 4   # on the CPU: a 2-layer model, the check of this script

Prints, and writes to ``--out``, its tokens/s (the median step after the first ``--warmup`` steps, the GPU
synchronised at each step's end) and ``torch.cuda.max_memory_allocated`` in MiB, with the machine. The peer of
``torchtitan``, which the issue names first, needs its own tokenizer and dataset files on the box: not in the
offline bundle yet.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from gpu_report import machine  # noqa: E402

# Llama-3.2-1B (conf/model/llama_1b.yaml): the same widths, heads, RoPE and tied embedding.
LLAMA_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": True,
    "max_position_embeddings": 131072,
}
TINY = {**LLAMA_1B, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
TINY |= {"num_attention_heads": 4, "num_key_value_heads": 2}


class RandomTokens(torch.utils.data.Dataset):
    """Uniform random token ids: the step's cost does not depend on which ids occur."""

    def __init__(self, rows: int, length: int, vocab: int) -> None:
        self.tokens = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=None, help="steps left out (default: 5, or 10 compiled)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (Trainer's torch_compile)")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: the check of this script")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    if not cuda and not args.tiny:
        parser.error("no CUDA device: run it on the GPU box, or with --tiny to check the script here")
    import transformers

    warmup = args.warmup if args.warmup is not None else (10 if args.compile else 5)
    if args.steps <= warmup:
        parser.error(f"--steps must exceed the {warmup} warm-up steps")
    shape = TINY if args.tiny else LLAMA_1B
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, attn_implementation="sdpa"))
    step_ends: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *_: Any, **__: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())

    run_dir = tempfile.TemporaryDirectory()  # Trainer's output_dir: nothing is saved there
    settings = transformers.TrainingArguments(
        output_dir=run_dir.name,
        per_device_train_batch_size=args.batch_size,
        max_steps=args.steps,
        learning_rate=3e-4,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        bf16=cuda,
        torch_compile=args.compile,
        use_cpu=not cuda,
        save_strategy="no",
        report_to=[],
        logging_steps=args.steps,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    data = RandomTokens(args.batch_size * args.steps, args.seq_length, shape["vocab_size"])
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = transformers.Trainer(model=model, args=settings, train_dataset=data, callbacks=[Clock()])
    trainer.train()
    run_dir.cleanup()
    steady = [end - start for start, end in zip(step_ends[warmup - 1 : -1], step_ends[warmup:])]
    result = {
        "trainer": f"transformers {transformers.__version__} Trainer",
        "model": "llama_1b" if not args.tiny else "tiny llama",
        "compile": args.compile,
        "batch_size": args.batch_size,
        "seq_length": args.seq_length,
        "steps": args.steps,
        "warmup": warmup,
        "step_s": statistics.median(steady),
        "tokens_per_sec": args.batch_size * args.seq_length / statistics.median(steady),
        "peak_allocated_mb": torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
        "machine": machine(),
    }
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
